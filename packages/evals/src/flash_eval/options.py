"""Option parsers shared by the commands."""

from __future__ import annotations

import click


def comma_list(choices: list[str]):
    def parse(ctx, param, value: str) -> list[str]:
        out = [x.strip() for x in value.split(",") if x.strip()]
        bad = [x for x in out if x not in choices]
        if bad or not out:
            raise click.BadParameter(f"choose from {', '.join(choices)}; got {value!r}")
        return out

    return parse


def int_list(ctx, param, value: str) -> list[int]:
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}")
    if any(x < 1 for x in out):
        raise click.BadParameter(f"lengths must be positive, got {value!r}")
    return out

