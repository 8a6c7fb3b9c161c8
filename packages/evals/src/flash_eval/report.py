"""Tables and charts of benchmark results."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

FLASH = "flash"
WIDENED = "flash-f32"  # float32 attention over 16-bit inputs (the patch's default)


def emit(report: dict, as_json: bool, print_table, plot_path: str | None = None, plot=None) -> None:
    """A command's report: JSON or its table, then its chart when asked."""
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        print_table(report)
    if plot_path:
        plot(report["results"], plot_path)
        if not as_json:
            click.echo(f"chart written to {plot_path}")


def add_ratios(results: list[dict]) -> None:
    """For each flash_attention row, its speed-up over every reference timed on
    the same case (reference time / flash time); for flash-f32's, over the
    references that are not flash_attention's."""
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in results:
        by_case.setdefault((r["case"], r["dtype"]), {})[r["impl"]] = r
    for rows in by_case.values():
        for own in (FLASH, WIDENED):
            flash = rows.get(own)
            if not flash or "median_ms" not in flash:
                continue
            flash["speedup"] = {
                name: r["median_ms"] / flash["median_ms"]
                for name, r in rows.items()
                if name != own and "median_ms" in r and (own == FLASH or not name.startswith(FLASH))
            }


def machine_lines(machine: dict) -> list[str]:
    """What ran where: the machine, MLX, the kernels, the copy bandwidth
    measured in the same run and each implementation."""
    cpu = machine.get("flashattn_cpu", {})
    lines = [
        f"{machine.get('gpu', machine['processor'])}, {machine['platform']}",
        f"MLX {machine['mlx']} on {machine['device']}; flashattn CPU kernels: "
        f"{cpu.get('isa')}, {cpu.get('threads')} threads",
    ]
    if machine.get("blas"):
        lines.append(f"MLX's BLAS: {machine['blas']}")
    if "copy_bandwidth_GBps" in machine:
        lines.append(f"memory: copy on all cores {machine['copy_bandwidth_GBps']:.1f} GB/s (read + write)")
    if machine.get("pages"):
        lines.append(machine["pages"])
    if machine.get("calls"):
        lines.append(f"short calls timed {machine['calls']}, up to 20 an evaluation (MLX)")
    if machine.get("kv_sets") == "auto":
        lines.append("keys and values: copies taken in turn, at least 256 MiB of them a batch (up to 20)")
    elif machine.get("kv_sets"):
        lines.append(f"keys and values: {machine['kv_sets']} copies taken in turn")
    lines += [f"{name}: {text}" for name, text in machine.get("impls", {}).items()]
    return lines


def kv_cell(r: dict) -> str:
    """K/V GB/s of a decode row, with its share of the copy measured just
    before it (CPU runs)."""
    if r["kind"] != "decode":
        return ""
    if "copy_GBps" in r:
        return f"{r['kv_GBps']:,.1f} ({r['kv_GBps'] / r['copy_GBps']:.0%} of {r['copy_GBps']:.1f})"
    return f"{r['kv_GBps']:,.1f}"


def print_kernel_table(results: list[dict], machine: dict) -> None:
    console = Console(width=max(Console().width, 120))
    console.print("\n".join(machine_lines(machine)))
    others = [name for name in machine.get("impls", {}) if name != FLASH]
    table = Table(title_justify="left")
    columns = ["case", "dtype", "impl", "median ms", "GFLOP/s", "K/V GB/s (of copy)"]
    columns += [f"flash vs {name}" for name in others] + ["max |err|", "peak MiB"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("case", "dtype", "impl") else "right", no_wrap=col == "case")
    previous = None
    for r in results:
        first = (r["case"], r["dtype"]) != previous
        previous = (r["case"], r["dtype"])
        head = [r["case"] if first else "", r["dtype"] if first else "", r["impl"]]
        if "skipped" in r:
            table.add_row(*head, "skipped: " + r["skipped"], *[""] * (len(columns) - 4))
            continue
        ratios = [f"{r['speedup'][name]:.2f}x" if name in r.get("speedup", {}) else "" for name in others]
        table.add_row(
            *head,
            f"{r['median_ms']:,.3f}",
            f"{r['gflops']:,.1f}",
            kv_cell(r),
            *ratios,
            f"{r['max_abs_error']:.1e}",
            "-" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:,.1f}",
        )
    console.print(table)


def kernel_markdown(results: list[dict], machine: dict) -> str:
    """The table as GitHub markdown, for READMEs and notes."""
    others = [name for name in machine.get("impls", {}) if name != FLASH]
    head = ["case", "dtype", "impl", "median ms", "GFLOP/s", "K/V GB/s (of copy)"]
    head += [f"flash vs {n}" for n in others] + ["max abs err", "peak MiB"]
    lines = [f"- {line}" for line in machine_lines(machine)] + [""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r["case"], r["dtype"], r["impl"]]
        if "skipped" in r:
            cells += ["skipped: " + r["skipped"]] + [""] * (len(head) - 4)
        else:
            cells += [
                f"{r['median_ms']:,.3f}",
                f"{r['gflops']:,.1f}",
                kv_cell(r),
                *[f"{r['speedup'][n]:.2f}x" if n in r.get("speedup", {}) else "" for n in others],
                f"{r['max_abs_error']:.1e}",
                "-" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:,.1f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_kernel(results: list[dict], path: str) -> None:
    """GFLOP/s per case (prefill and chunks) and K/V GB/s (decode), one bar
    per impl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = list(dict.fromkeys(r["impl"] for r in results))
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    panels = ((axes[0], ("prefill", "chunk"), "gflops", "GFLOP/s"), (axes[1], ("decode",), "kv_GBps", "K/V GB/s"))
    for ax, kinds, key, unit in panels:
        cases = list(dict.fromkeys(f"{r['case']}\n{r['dtype']}" for r in results if r["kind"] in kinds))
        width = 0.8 / max(1, len(impls))
        for i, impl in enumerate(impls):
            values = []
            for c in cases:
                hit = [r for r in results if f"{r['case']}\n{r['dtype']}" == c and r["impl"] == impl and key in r]
                values.append(hit[0][key] if hit else 0.0)
            ax.bar([x + i * width for x in range(len(cases))], values, width, label=impl)
        ax.set_xticks([x + width * (len(impls) - 1) / 2 for x in range(len(cases))])
        ax.set_xticklabels(cases, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel(unit)
        ax.set_yscale("log")
        ax.set_title(f"{' and '.join(kinds)} (missing bar: skipped or not run)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
