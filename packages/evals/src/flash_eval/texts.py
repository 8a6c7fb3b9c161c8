"""The texts perplexity is measured on: WikiText-2 (test) through Hugging Face
`datasets` (the hub, or its cache), a local text / parquet file or folder, or
the English prose every CPython ships (`pydoc_data.topics`)."""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse


class TextError(ValueError):
    pass


@dataclass
class Text:
    name: str  # what was read, for the report
    content: str
    note: str = ""  # e.g. why a fallback was used


def pydocs() -> Text:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    content = "\n\n".join(topics[k] for k in sorted(topics))
    return Text("Python language reference (pydoc_data.topics, ships with CPython)", content)


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


@contextmanager
def _offline():
    """datasets and huggingface_hub in offline mode (the cache only) for the
    duration: they read the environment once, at import, so their flags are
    set directly."""
    import datasets
    import huggingface_hub.constants as hub

    saved = (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub.HF_HUB_OFFLINE = saved


def wikitext() -> Text:
    """wikitext-2-raw-v1, test split, from the hub or, when the hub cannot be
    reached, the datasets cache; rows joined with blank lines as in Hugging
    Face's perplexity guide."""
    import datasets

    reachable = _hub_reachable()
    try:
        with nullcontext() if reachable else _offline():
            rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"]
    except Exception as e:
        where = "the Hugging Face hub" if reachable else "the datasets cache (the hub is unreachable)"
        raise TextError(f"WikiText could not be loaded from {where}: {type(e).__name__}: {e}") from None
    return Text("wikitext-2-raw-v1 test (Hugging Face datasets)", "\n\n".join(rows))


def _read_parquet(paths: list[Path]) -> str:
    import datasets

    table = datasets.load_dataset("parquet", data_files=[str(p) for p in paths], split="train")
    if "text" not in table.column_names:
        raise TextError(f"parquet files have no 'text' column (columns: {table.column_names})")
    return "\n\n".join(table["text"])


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TextError(f"{path} is not UTF-8 text: {e}") from None


def local(path_str: str) -> Text:
    path = Path(path_str).expanduser()
    if not path.exists():
        raise TextError(f"no such file or folder: {path}")
    try:
        if path.is_dir():
            parquet = sorted(path.rglob("*.parquet"))
            if parquet:
                content = _read_parquet(parquet)
            else:
                files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".raw", ".md"))
                if not files:
                    raise TextError(f"{path} holds no .parquet, .txt, .raw or .md files")
                content = "\n\n".join(_read_text(p) for p in files)
        elif path.suffix == ".parquet":
            content = _read_parquet([path])
        else:
            content = _read_text(path)
    except PermissionError as e:
        raise TextError(f"cannot read {path}: {e}") from None
    if not content.strip():
        raise TextError(f"{path} holds no text")
    return Text(f"{path.name} (local: {path})", content)


def load_text(dataset: str) -> Text:
    """dataset: 'auto' (WikiText if it can be had, else the Python docs),
    'wikitext', 'pydocs', or a local path."""
    if dataset == "pydocs":
        return pydocs()
    if dataset == "wikitext":
        return wikitext()
    if dataset == "auto":
        try:
            return wikitext()
        except TextError as e:
            fallback = pydocs()
            fallback.note = f"WikiText unavailable ({e}); using the Python docs instead"
            return fallback
    if os.sep in dataset or Path(dataset).exists() or dataset.startswith((".", "~")):
        return local(dataset)
    raise TextError(
        f"unknown dataset {dataset!r}: use wikitext, pydocs, auto, or a path to a text / parquet file or folder"
    )
