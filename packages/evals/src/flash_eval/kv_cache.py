"""`--kv-bits` / `--kv-group-size`: the KV cache a model command's passes run
on. Quantized, every pass, patch off and on alike, holds its keys and values
in mlx-lm's `QuantizedKVCache` in every attention layer, so that the two
settings compare mlx-lm's quantized attention with the patch's on the same
cache and the same text. The caches are mlx-lm's own: `make_prompt_cache`,
then `maybe_quantize_kv_cache` (what `generate_step` does for `--kv-bits`)
from the first token on (`quantized_kv_start` 0, and before the first step
rather than after it, so that no attention call reads unquantized keys)."""

from __future__ import annotations

from dataclasses import dataclass

import click
import mlx.core as mx
from mlxlm_flash_patch import pacing

from .setting import patch_setting

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64  # mlx-lm's
BITS_HINT, GROUP_HINT = "'--kv-bits'", "'--kv-group-size'"  # quoted as click quotes its own errors' options


@dataclass(frozen=True)
class KVCacheSetting:
    bits: int | None = None  # None: the ordinary cache, keys and values in the model's dtype
    group_size: int | None = None

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def describe(self) -> str:
        return f"{self.bits}-bit, group {self.group_size}" if self.quantized else "model dtype"

    def header_line(self, paced: bool = False) -> str:
        if not self.quantized:
            return "KV cache: model dtype"
        line = f"KV cache: {self.describe()} (mlx-lm's QuantizedKVCache in every attention layer, patch off and on)"
        if paced:  # the patch's prefill holds less memory this way, at some speed (docs/cuda.md)
            line += "; the patch paces its prefill steps (MLX_FLASH_ATTENTION_PACING=0: unpaced)"
        return line

    def as_json(self) -> dict:
        """The setting as a report's fields; kv_pacing: whether the patch's
        prefill over this cache runs paced here (mlxlm_flash_patch.pacing:
        CUDA only)."""
        return {"kv_cache": self.describe(), "kv_bits": self.bits, "kv_group_size": self.group_size,
                "kv_pacing": self.quantized and pacing.enabled()}


def _as_int(ctx, param, value):
    return None if value is None else int(value)


def kv_cache_options(command):
    """The two options, for a command that takes kv_bits and kv_group_size."""
    command = click.option(
        "--kv-group-size", type=click.Choice([str(g) for g in GROUP_SIZES]), default=str(DEFAULT_GROUP_SIZE),
        show_default=True, callback=_as_int,
        help="Group size of the quantized KV cache (with --kv-bits; must divide the model's head dim).")(command)
    return click.option(
        "--kv-bits", type=click.Choice([str(b) for b in BITS]), default=None, callback=_as_int,
        help="Quantize the KV cache (mlx-lm's QuantizedKVCache) to this many bits in every pass, patch off and "
             "on [default: none, keys and values in the model's dtype].")(command)


def from_options(kv_bits: int | None, kv_group_size: int) -> KVCacheSetting:
    """The setting the options ask for. A group size given without --kv-bits
    is refused rather than ignored: a run that meant to quantize must not
    quietly measure the ordinary cache."""
    if kv_bits is None:
        source = click.get_current_context().get_parameter_source("kv_group_size")
        if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP"):
            raise click.BadParameter(f"{kv_group_size} was given without --kv-bits; it sets the group size of a "
                                     "quantized KV cache (--kv-bits 4 or 8)", param_hint=GROUP_HINT)
        return KVCacheSetting()
    return KVCacheSetting(kv_bits, kv_group_size)


def make_cache(model, kv: KVCacheSetting) -> list:
    """A fresh cache for one pass, as mlx-lm builds it: quantized from the
    first token when asked."""
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    if kv.quantized:
        maybe_quantize_kv_cache(cache, quantized_kv_start=0, kv_group_size=kv.group_size, kv_bits=kv.bits)
    return cache


def check(model, kv: KVCacheSetting, patches=("off",)) -> None:
    """Refuse, naming the option, a quantized cache mlx-lm cannot give this
    model, or cannot run: with its own quantized attention when the patch off
    is asked for (it has no CUDA kernel for some head shapes), else with the
    patch on; cheap (one token through the model), so it runs before any
    long work."""
    if not kv.quantized:
        return
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    kinds = ", ".join(sorted({type(c).__name__ for c in cache})) or "none"
    # maybe_quantize_kv_cache converts the caches that have to_quantized and
    # leaves the others (a state-space layer's ArraysCache) as they are.
    if not any(hasattr(c, "to_quantized") for c in cache):
        raise click.BadParameter(f"{kv.bits} needs a KV cache to quantize, and this model has none (its layers' "
                                 f"caches: {kinds})", param_hint=BITS_HINT)
    try:
        make_cache(model, kv)
    except NotImplementedError as e:  # RotatingKVCache (sliding-window layers): mlx-lm's "Quantization NYI"
        raise click.BadParameter(f"{kv.bits} needs every attention layer's cache quantized, and mlx-lm cannot "
                                 f"quantize this model's caches ({kinds}): {e}", param_hint=BITS_HINT) from None
    dims = head_dims(model)
    if any(d % kv.group_size for d in dims):
        fits = [g for g in GROUP_SIZES if all(d % g == 0 for d in dims)]
        choose = f"choose {' or '.join(map(str, fits))}" if fits else "no group size mlx-lm offers does"
        raise click.BadParameter(
            f"{kv.group_size} does not divide the model's head dim ({', '.join(map(str, sorted(dims)))}): mlx-lm "
            f"quantizes keys and values in groups along it; {choose}", param_hint=GROUP_HINT)
    patch = "off" if "off" in patches else "on"
    try:  # whatever else mlx-lm refuses on a quantized cache, it refuses here
        with patch_setting(patch, "float32"):
            mx.eval(model(mx.array([[0]]), cache=make_cache(model, kv)))
    except Exception as e:
        who = "mlx-lm" if patch == "off" else "mlx-lm with the patch on"
        hint = "; --patch on alone measures ours" if patch == "off" and "on" in patches else ""
        raise click.BadParameter(f"{kv.bits}: {who} cannot run this model on a quantized KV cache "
                                 f"({type(e).__name__}: {e}){hint}", param_hint=BITS_HINT) from None


def head_dims(model) -> set[int]:
    """The head dims of the keys and values the quantizable caches hold, read
    from them after one token (with mlx-lm's own attention): configs name
    them in too many ways."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    with patch_setting("off", "float32"):
        mx.eval(model(mx.array([[0]]), cache=cache))
    return {a.shape[-1] for c in cache if hasattr(c, "to_quantized") and c.keys is not None
            for a in (c.keys, c.values)}
