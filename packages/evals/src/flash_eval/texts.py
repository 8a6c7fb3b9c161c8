"""The texts perplexity is measured on: WikiText-2 raw (test split) from the
Hugging Face hub through `datasets` or, when the hub cannot be reached, the
copy this package ships; a local text / parquet file or folder; or the English
prose every CPython ships (`pydoc_data.topics`)."""

from __future__ import annotations

import os
import socket
import threading
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


WIKITEXT = "WikiText-2 raw, test split"
# The copy the package ships (see data/WIKITEXT-LICENSE.txt): the non-empty
# lines of the hub's test split, in order, CRLF line ends, xz-compressed.
SHIPPED_WIKITEXT = "wikitext-2-raw-v1-test.raw.xz"
SHIPPED_WIKITEXT_SHA256 = "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c"  # uncompressed
HUB_PROBE_SECONDS = 3.0


def _offline_flag() -> str | None:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return name
    return None


def _hub_unreachable(timeout: float = HUB_PROBE_SECONDS) -> str | None:
    """None when the hub's host accepts a TCP connection within `timeout`
    seconds, else why not. Name lookup included: the probe runs in a daemon
    thread, as a socket timeout does not bound getaddrinfo (which can hang
    for tens of seconds on a machine with no network)."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = url.hostname, url.port or (80 if url.scheme == "http" else 443)
    answer: list[str | None] = []

    def probe():
        try:
            with socket.create_connection((host, port), timeout=timeout):
                answer.append(None)
        except socket.gaierror:
            answer.append(f"the Hugging Face hub ({host}) could not be reached: its name does not resolve")
        except (OSError, UnicodeError) as e:
            answer.append(f"the Hugging Face hub ({host}) could not be reached: {type(e).__name__}: {e}")

    thread = threading.Thread(target=probe, name="flash-eval-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if not answer:
        return f"the Hugging Face hub ({host}) did not answer within {timeout:g} s"
    return answer[0]


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


def join_wikitext(rows) -> str:
    """WikiText's rows (the hub's) or lines (the shipped copy's) as one text:
    the non-empty ones in order, each ending in one "\n".

    Why not Hugging Face's perplexity guide's "\n\n".join(rows): the hub's
    split has 1,467 empty rows (blank lines) among its 4,358, the shipped copy
    only the 2,891 non-empty lines, and where the blank lines were is not
    recorded. Dropping them from the hub's rows is the one join under which
    both sources give the same text, so the same token stream and the same
    perplexity whichever was reachable. Line ends are normalised as well (the
    shipped lines end in CRLF, the hub's rows in LF). Blank lines carry no
    words; the price is that figures are not comparable with ones taken on
    the guide's join (which scores extra newline tokens)."""
    return "".join(row.rstrip("\r\n") + "\n" for row in rows if row.strip())


def shipped_wikitext_path():
    """The package's copy (an importlib.resources Traversable; may be absent)."""
    from importlib.resources import files

    return files("flash_eval") / "data" / SHIPPED_WIKITEXT


def read_shipped_wikitext() -> bytes | None:
    """The shipped copy's bytes, decompressed and checked; None when this
    installation has none."""
    import hashlib
    import lzma

    path = shipped_wikitext_path()
    if not path.is_file():
        return None
    raw = lzma.decompress(path.read_bytes())
    digest = hashlib.sha256(raw).hexdigest()
    if digest != SHIPPED_WIKITEXT_SHA256:
        raise TextError(f"the shipped WikiText copy ({path}) is damaged: sha256 {digest}, "
                        f"expected {SHIPPED_WIKITEXT_SHA256}")
    return raw


def _from_hub(offline: bool) -> list[str]:
    import datasets

    with _offline() if offline else nullcontext():
        # The hub's full id: a bare "wikitext" would first be looked for as
        # a folder in the working directory.
        return datasets.load_dataset("Salesforce/wikitext", "wikitext-2-raw-v1", split="test")["text"]


def wikitext() -> Text:
    """wikitext-2-raw-v1, test split: from the Hugging Face hub when it
    answers (through `datasets`), else the copy shipped with this package,
    else the datasets cache. The text is the same from each (join_wikitext)."""
    why = []  # why the hub was not used
    flag = _offline_flag()
    if flag:
        why.append(f"{flag} is set")
    elif unreachable := _hub_unreachable():
        why.append(unreachable)
    else:
        try:
            return Text(f"{WIKITEXT} (Hugging Face hub)", join_wikitext(_from_hub(offline=False)))
        except Exception as e:
            why.append(f"the Hugging Face hub failed: {type(e).__name__}: {_first_line(e)}")
    raw = read_shipped_wikitext()
    if raw is not None:
        return Text(f"{WIKITEXT} (shipped copy)", join_wikitext(raw.decode("utf-8").split("\n")),
                    note=f"{why[0]}; read the copy shipped with flash-eval")
    why.append(f"this installation has no shipped copy (flash_eval/data/{SHIPPED_WIKITEXT})")
    try:
        rows = _from_hub(offline=True)
    except Exception as e:
        why.append(f"the datasets cache has none ({type(e).__name__}: {_first_line(e)})")
        raise TextError(f"{WIKITEXT} could not be read: " + "; ".join(why) +
                        ". Use --dataset pydocs, or a local file: --dataset path/to/wiki.test.raw") from None
    return Text(f"{WIKITEXT} (Hugging Face datasets cache)", join_wikitext(rows), note="; ".join(why))


def _first_line(e: Exception) -> str:
    line = (str(e).strip().splitlines() or [""])[0]
    return line if len(line) <= 200 else line[:200] + "..."


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
    """dataset: 'wikitext' (the default; hub or shipped copy), 'pydocs', or a
    local path."""
    if dataset == "pydocs":
        return pydocs()
    if dataset == "wikitext":
        return wikitext()
    if os.sep in dataset or Path(dataset).exists() or dataset.startswith((".", "~")):
        return local(dataset)
    raise TextError(f"unknown dataset {dataset!r}: use wikitext, pydocs, or a path to a text / parquet file or folder")
