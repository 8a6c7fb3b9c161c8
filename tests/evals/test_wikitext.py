"""`--dataset wikitext`: WikiText-2 raw (test split) from the Hugging Face hub
when it answers, else the copy flash-eval ships; the run says which. The hub
is never reached here: the tests force it offline, unreachable or faked."""

import json
import lzma
import socket
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_models import save_model_folder

from flash_eval import texts
from flash_eval.cli import main

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext-2-raw-v1" / "wiki.test.raw"
SHIPPED_NAME = "WikiText-2 raw, test split (shipped copy)"


def need_shared() -> bytes:
    """The reference text the shipped copy must equal: ../shared beside the
    checkout (the project's data folder), which a lone clone lacks."""
    if not SHARED.exists():
        pytest.skip(f"needs ../shared/data/wikitext-2-raw-v1/wiki.test.raw beside the checkout (not at {SHARED})")
    return SHARED.read_bytes()


@pytest.fixture
def shipped():
    """The package's copy: part of the repository, so its absence fails."""
    path = texts.shipped_wikitext_path()
    assert path.is_file(), f"the evals package lost its WikiText copy ({path}; scripts/ship-wikitext writes it)"
    return path


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", "/nonexistent-flash-eval-test-cache")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_folder(tmp_path_factory.mktemp("tiny-model"))


def test_shipped_copy_is_the_wikitext_test_split_byte_for_byte(shipped):
    path = shipped
    assert lzma.decompress(path.read_bytes()) == need_shared()
    assert texts.read_shipped_wikitext() == need_shared()
    assert (path.parent / "WIKITEXT-LICENSE.txt").is_file()


def test_licence_and_attribution_beside_the_copy():
    text = (texts.shipped_wikitext_path().parent / "WIKITEXT-LICENSE.txt").read_text()
    for words in ("CC BY-SA 3.0", "GFDL", "Merity", "Xiong", "Bradbury", "Socher", "Pointer Sentinel Mixture Models"):
        assert words in text


def test_hub_rows_and_shipped_lines_give_the_same_text():
    """The hub's rows: every line ending in LF, with empty rows (blank lines)
    between some; the shipped copy: the non-empty lines, CRLF. One text."""
    raw = need_shared().decode("utf-8")
    lines = raw.split("\r\n")[:-1]
    rows = [""]
    for line in lines:
        rows.append(line + "\n")
        if line.startswith(" = "):  # the hub has blank rows around headings
            rows.append("")
    from_hub = texts.join_wikitext(rows)
    from_file = texts.join_wikitext(raw.split("\n"))
    assert from_hub == from_file == raw.replace("\r\n", "\n")
    assert "\r" not in from_file and "\n\n" not in from_file


def test_perplexity_offline_reads_the_shipped_copy_and_says_so(model_dir, shipped, offline):
    r = CliRunner().invoke(main, ["perplexity", "--model", str(model_dir), "--dataset", "wikitext",
                                  "--context", "32", "--tokens", "100", "--patch", "on", "--json"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["text"]["name"] == SHIPPED_NAME
    assert "HF_HUB_OFFLINE is set; read the copy shipped with flash-eval" in rep["text"]["note"]
    assert rep["text"]["tokens"] > 100_000 and rep["text"]["tokens_used"] == 100


def test_the_default_dataset_is_wikitext(model_dir, shipped, offline):
    r = CliRunner().invoke(main, ["perplexity", "--model", str(model_dir), "--context", "32", "--tokens", "64",
                                  "--patch", "off"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert f"text: {SHIPPED_NAME}:" in out and "read the copy shipped with flash-eval" in out


def test_unreachable_hub_falls_back_to_the_shipped_copy(shipped, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(texts, "_hub_unreachable", lambda: "the Hugging Face hub (x) did not answer within 3 s")
    text = texts.load_text("wikitext")
    assert text.name == SHIPPED_NAME and text.note.startswith("the Hugging Face hub (x) did not answer")
    assert text.content == need_shared().decode("utf-8").replace("\r\n", "\n")


def test_the_hub_when_it_answers(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(texts, "_hub_unreachable", lambda: None)
    monkeypatch.setattr(texts, "_from_hub", lambda offline: ["", " = A = \n", "", " b c \n"])
    text = texts.load_text("wikitext")
    assert text.name == "WikiText-2 raw, test split (Hugging Face hub)" and not text.note
    assert text.content == " = A = \n b c \n"


def test_the_hub_probe_is_bounded_in_time(monkeypatch):
    """A host that never answers (or a name lookup that hangs) costs the
    probe's timeout, not the system's."""
    released = threading.Event()

    def hang(*args, **kwargs):
        released.wait(30)
        raise OSError("released by the test")  # the probe thread ends quietly

    monkeypatch.setattr(socket, "create_connection", hang)
    start = time.perf_counter()
    why = texts._hub_unreachable(timeout=0.5)
    elapsed = time.perf_counter() - start
    released.set()
    assert elapsed < 3
    assert why == "the Hugging Face hub (huggingface.co) did not answer within 0.5 s"


def test_the_hub_probe_says_why(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert "could not be reached" in texts._hub_unreachable(timeout=2)


def test_no_hub_and_no_shipped_copy_is_a_clear_error(model_dir, offline, tmp_path, monkeypatch):
    monkeypatch.setattr(texts, "shipped_wikitext_path", lambda: tmp_path / "none.xz")
    with pytest.raises(texts.TextError) as e:
        texts.load_text("wikitext")
    message = str(e.value)
    for words in ("HF_HUB_OFFLINE is set", "no shipped copy", "the datasets cache has none", "--dataset pydocs"):
        assert words in message
    r = CliRunner().invoke(main, ["perplexity", "--model", str(model_dir)])
    assert r.exit_code != 0 and "could not be read" in r.output


def test_a_damaged_shipped_copy_is_refused(tmp_path, monkeypatch, offline):
    copy = tmp_path / "bad.xz"
    copy.write_bytes(lzma.compress(b" = A = \r\n"))
    monkeypatch.setattr(texts, "shipped_wikitext_path", lambda: copy)
    with pytest.raises(texts.TextError, match="damaged"):
        texts.load_text("wikitext")


def test_pydocs_only_when_asked(model_dir, offline):
    r = CliRunner().invoke(main, ["perplexity", "--model", str(model_dir), "--dataset", "pydocs", "--context", "32",
                                  "--tokens", "64", "--patch", "off", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "pydoc_data" in json.loads(r.output)["text"]["name"]
    with pytest.raises(texts.TextError, match="unknown dataset 'auto'"):
        texts.load_text("auto")
