"""The flash-eval command line."""

from __future__ import annotations

import click

from . import __version__
from .demo import demo
from .kernel import kernel


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="flash-eval")
def main():
    """Measure flashattn-core and mlxlm-flash-patch against MLX's own attention."""


main.add_command(demo)
main.add_command(kernel)
