"""Progress bars on long work: on stderr, silent without a terminal or with --json."""

from __future__ import annotations

import sys
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    TaskProgressColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)


def interactive(quiet: bool = False) -> bool:
    return not quiet and sys.stderr.isatty()


@contextmanager
def progress_bar(total: int, description: str, quiet: bool):
    """Yields advance(n=1)."""
    if not interactive(quiet):
        yield lambda n=1: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)


@contextmanager
def staged_progress(quiet: bool):
    """Yields update(stage, done, total): one bar per stage, shown as it starts."""
    if not interactive(quiet):
        yield lambda stage, done, total: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        tasks = {}

        def update(stage, done, total):
            if stage not in tasks:
                tasks[stage] = progress.add_task(stage, total=total)
            progress.update(tasks[stage], completed=done)

        yield update
