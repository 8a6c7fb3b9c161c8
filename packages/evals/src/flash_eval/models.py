"""Which model a command runs: the embedded Qwen2.5-Coder-0.5B (provisioned
into the cache on first use) or any mlx-lm model folder or hub id."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import click

from . import embedded_model

EMBEDDED = "embedded"


class ModelError(ValueError):
    pass


@dataclass
class LoadedModel:
    name: str
    path: str
    model: object
    tokenizer: object
    config: dict

    @property
    def parameters(self) -> int:
        from mlx.utils import tree_flatten

        return sum(v.size for _, v in tree_flatten(self.model.parameters()))


def provision_embedded(dtype: str, quiet: bool) -> Path:
    from .progress import staged_progress

    if embedded_model.is_provisioned(dtype):
        return embedded_model.model_dir(dtype)
    say = (lambda m: None) if quiet else (lambda m: click.echo(f"[model] {m}", err=True))
    try:
        with staged_progress(quiet) as update:
            return embedded_model.provision(dtype, say, update)
    except embedded_model.ProvisionError as e:
        raise ModelError(str(e)) from None


def check_folder(path: Path) -> None:
    if not path.is_dir():
        raise ModelError(f"{path} is not a folder")
    if not (path / "config.json").exists():
        raise ModelError(f"{path} is not an mlx-lm model folder: it has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ModelError(f"{path} is not an mlx-lm model folder: it has no *.safetensors weights")
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}/config.json cannot be read: {e}") from None


def load_model(spec: str, dtype: str | None, quiet: bool = False, ranks=None) -> LoadedModel:
    """spec: 'embedded', a local folder, or a Hugging Face hub id. dtype: the
    embedded model is provisioned in it (float32 when None); other models are
    cast to it when given. Under mlx.launch (ranks of more than one), rank 0
    provisions the embedded model while the others wait, then all load it."""
    from mlx_lm import load

    if spec == EMBEDDED:
        dtype = dtype or "float32"
        if ranks is not None and ranks.size > 1:
            if ranks.is_main:
                provision_embedded(dtype, quiet)
            ranks.barrier()
        path = provision_embedded(dtype, quiet)
        name = f"Qwen2.5-Coder-0.5B-Instruct (embedded, {dtype})"
    else:
        path = Path(spec).expanduser()
        if path.exists() or spec.startswith((".", "/", "~")):
            check_folder(path)
        name = spec
    try:
        model, tokenizer, config = load(str(path), return_config=True)
    except Exception as e:
        raise ModelError(f"mlx-lm could not load {spec!r}: {type(e).__name__}: {e}") from None
    if spec != EMBEDDED and dtype:
        import mlx.core as mx

        model.set_dtype(getattr(mx, dtype))
    return LoadedModel(name, str(path), model, tokenizer, config)
