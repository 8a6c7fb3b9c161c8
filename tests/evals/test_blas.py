"""Which BLAS flash-eval preloads on Linux: Debian's OpenBLAS when installed,
else MKL from the mkl wheel, else none (MLX's reference BLAS, said to be
slow); FLASH_EVAL_BLAS picks or turns it off. The choice is tested on fake
paths; the last test checks the real one in this environment."""

import json
import os
import platform
import subprocess
import sys

import pytest
from tiny_models import save_model_folder

from flash_eval import blas

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
MKL = "/env/lib/libmkl_rt.so.3"


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, "auto"),
        ({"FLASH_EVAL_BLAS": "mkl"}, "mkl"),
        ({"FLASH_EVAL_BLAS": "OpenBLAS"}, "openblas"),
        ({"FLASH_EVAL_BLAS": "off"}, "off"),
        ({"FLASH_EVAL_BLAS": "0"}, "off"),
        ({"FLASH_EVAL_OPENBLAS": "0"}, "off"),  # the older name still turns it off
        ({"FLASH_EVAL_OPENBLAS": "1"}, "auto"),
        ({"FLASH_EVAL_BLAS": "mkl", "FLASH_EVAL_OPENBLAS": "0"}, "mkl"),  # the new name wins
    ],
)
def test_setting(environ, expected):
    assert blas.setting(environ) == expected


def test_a_bad_setting_is_refused():
    with pytest.raises(ValueError, match="FLASH_EVAL_BLAS='blis'"):
        blas.setting({"FLASH_EVAL_BLAS": "blis"})


@pytest.mark.parametrize(
    "which, openblas, mkl, expected",
    [
        ("auto", OPENBLAS, MKL, ("OpenBLAS", OPENBLAS)),  # Debian's OpenBLAS first when present
        ("auto", None, MKL, ("MKL", MKL)),  # only MKL
        ("auto", None, None, None),  # neither: MLX's own BLAS
        ("mkl", OPENBLAS, MKL, ("MKL", MKL)),
        ("mkl", OPENBLAS, None, None),
        ("openblas", None, MKL, None),
        ("off", OPENBLAS, MKL, None),
    ],
)
def test_choice(which, openblas, mkl, expected):
    choice = blas.choose(which, openblas, mkl)
    assert (choice and (choice.name, choice.path)) == expected


@pytest.mark.parametrize(
    "environ, system, expected",
    [
        ({}, "Linux", "MKL"),
        ({}, "Darwin", None),  # Accelerate
        ({"FLASH_EVAL_OPENBLAS": "0"}, "Linux", None),
        ({blas.REEXEC_MARK: MKL}, "Linux", None),  # already restarted
        ({"LD_PRELOAD": "/x/libmkl_rt.so.2"}, "Linux", None),  # the user preloaded one
        ({"LD_PRELOAD": "/usr/lib/libopenblas.so.0 /y/libjemalloc.so"}, "Linux", None),
        ({"LD_PRELOAD": "/y/libjemalloc.so"}, "Linux", "MKL"),
    ],
)
def test_plan(environ, system, expected):
    choice = blas.plan(environ, system=system, openblas=None, mkl=MKL, look=False)
    assert (choice and choice.name) == expected


def test_find_mkl_in_the_environment(tmp_path):
    assert blas.find_mkl([str(tmp_path)]) is None
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libmkl_rt.so.2").touch()
    assert blas.find_mkl([str(tmp_path)]) == str(tmp_path / "lib" / "libmkl_rt.so.2")
    (tmp_path / "lib" / "libmkl_rt.so.3").touch()
    assert blas.find_mkl([str(tmp_path)]) == str(tmp_path / "lib" / "libmkl_rt.so.3")
    other = tmp_path / "other"
    (other / "lib").mkdir(parents=True)
    (other / "lib" / "libmkl_rt.so.4").touch()  # a later soname
    assert blas.find_mkl([str(other)]) == str(other / "lib" / "libmkl_rt.so.4")


def test_preload_env():
    env = blas.preload_env({"LD_PRELOAD": "/y/libjemalloc.so", "PATH": "/bin"}, blas.Choice("OpenBLAS", OPENBLAS))
    assert env["LD_PRELOAD"] == f"{OPENBLAS}:/y/libjemalloc.so" and env[blas.REEXEC_MARK] == OPENBLAS
    assert env["PATH"] == "/bin" and not any(k.startswith(("MKL_", "KMP_")) for k in env)
    env = blas.preload_env({}, blas.Choice("MKL", MKL))
    assert env["LD_PRELOAD"] == MKL
    assert all(env[k] == v for k, v in blas.MKL_DEFAULTS.items())
    for key in blas.MKL_DEFAULTS:  # what the user set stays
        assert blas.preload_env({key: "7"}, blas.Choice("MKL", MKL))[key] == "7"


@pytest.mark.parametrize(
    "maps, name, slow",
    [
        (["/v/site-packages/numpy.libs/libscipy_openblas64_-ff651d7f.so", "/v/mlx/lib/libblas-bd8a282c.so.3.10.0"],
         "reference BLAS bundled with mlx-cpu", True),
        ([OPENBLAS, MKL, "/v/mlx/lib/libblas-bd8a282c.so.3.10.0"], "OpenBLAS", False),
        ([MKL, "/env/lib/libmkl_core.so.3", "/v/mlx/lib/libblas-bd8a282c.so.3.10.0"], "MKL", False),
        (["/lib/libc.so.6"], "unknown", False),
    ],
)
def test_describe(maps, name, slow):
    info = blas.describe(maps, system="Linux")
    assert (info["name"], info["slow"]) == (name, slow)


@pytest.mark.skipif(platform.system() != "Linux", reason="the preloading is Linux's")
def test_this_environment_runs_on_an_optimised_blas(tmp_path):
    """The workspace installs MKL (flashattn-evals[mkl]) on x86-64 Linux:
    `flash-eval perplexity` restarts itself on it, or on Debian's OpenBLAS
    where that is installed, never on the reference BLAS."""
    expected = blas.plan()
    assert expected is not None, ("neither Debian's OpenBLAS nor the mkl wheel's libmkl_rt is installed: "
                                  "MLX would run on its reference BLAS")
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLASH_EVAL_BLAS", "FLASH_EVAL_OPENBLAS", blas.REEXEC_MARK, "LD_PRELOAD")}
    text = tmp_path / "text.txt"
    text.write_text("A generator function returns an iterator; each call of next resumes it. " * 20)
    model = save_model_folder(tmp_path / "model")
    r = subprocess.run([sys.executable, "-m", "flash_eval", "perplexity", "--model", str(model), "--dataset",
                        str(text), "--context", "32", "--tokens", "64", "--patch", "off", "--json"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout[r.stdout.index("{"):])
    assert report["blas"].startswith(expected.name) and "preloaded by flash-eval" in report["blas"]
    assert "slow" not in report["blas"]


@pytest.mark.parametrize(
    "info, openblas, mkl, expected",
    [
        ({"name": "MKL", "path": MKL, "slow": False}, None, MKL, "MKL"),
        ({"name": "reference BLAS bundled with mlx-cpu", "path": "/v/mlx/lib/libblas.so.3", "slow": True}, None, MKL,
         f"reference BLAS bundled with mlx-cpu, which sets MLX's float32 times (an optimised one: LD_PRELOAD={MKL} "
         "flash-eval kernel ...)"),
        ({"name": "reference BLAS bundled with mlx-cpu", "path": "/v/mlx/lib/libblas.so.3", "slow": True}, OPENBLAS,
         MKL, f"reference BLAS bundled with mlx-cpu, which sets MLX's float32 times (an optimised one: "
              f"LD_PRELOAD={OPENBLAS} flash-eval kernel ...)"),
    ],
)
def test_kernel_note(monkeypatch, info, openblas, mkl, expected):
    # flash-eval kernel preloads nothing: it names MLX's BLAS, and on the
    # reference one says how to run on an optimised one.
    monkeypatch.setattr(blas, "describe", lambda: info)
    monkeypatch.setattr(blas, "find_openblas", lambda: openblas)
    monkeypatch.setattr(blas, "find_mkl", lambda: mkl)
    assert blas.kernel_note() == expected


def test_kernel_note_without_an_optimised_blas(monkeypatch):
    monkeypatch.setattr(blas, "describe", lambda: {"name": "reference BLAS bundled with mlx-cpu", "slow": True})
    monkeypatch.setattr(blas, "find_openblas", lambda: None)
    monkeypatch.setattr(blas, "find_mkl", lambda: None)
    assert "pip install 'flashattn-evals[mkl]'" in blas.kernel_note()
