"""Where flash-eval keeps what it provisions, and how it writes there without
ever leaving a half-written entry: everything is built in a temporary folder
next to its final place and renamed into it at the end."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    """FLASH_EVAL_CACHE, else $XDG_CACHE_HOME/flash-eval, else ~/.cache/flash-eval."""
    if os.environ.get("FLASH_EVAL_CACHE"):
        return Path(os.environ["FLASH_EVAL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "flash-eval"


@contextmanager
def building(final: Path):
    """Yields a temporary folder; on success it becomes `final` (atomically),
    on any error it is removed and `final` is untouched."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield tmp
        if final.exists():  # built meanwhile by another process: keep theirs
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def scratch_folder(parent: Path):
    """A temporary folder under `parent` (same file system, so files built in
    it can be renamed into place), removed afterwards whatever happens."""
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".scratch.", dir=parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
