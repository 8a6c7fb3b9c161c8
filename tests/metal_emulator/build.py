"""Builds the emulator: flashattn-core's Metal source, with one kernel per
instance its dispatch launches (signatures written as MLX's fast::metal_kernel
writes them), compiled by clang as C++ against msl.h, and loaded with ctypes.

The library is cached by the hash of everything that goes into it, so a
second test session skips the compile (about a minute on 2 cores)."""

from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ABI_DIR = HERE.parents[1] / "packages" / "flashattn-core" / "csrc" / "metal"
RUNTIME_SOURCES = ["runtime.cpp", "entry.cpp"]
HAND_WRITTEN = ["runtime.h", "runtime.cpp", "entry.cpp", "instances.h", "msl.h", "include/metal_stdlib"]
FLAGS = [
    "-std=c++20", "-O2", "-fPIC", "-pthread",
    "-Wno-unknown-attributes", "-Wno-duplicate-decl-specifier",
]

# MLX adds a kernel argument [[name]] for each of these its body mentions
# (backend/common/metal_kernel.cpp), in this order.
ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]

# The value of each attribute for one lane, from fa_emu::LaneIds.
def _uint3(field: str) -> str:
    return f"uint3{{id.{field}[0], id.{field}[1], id.{field}[2]}}"


LANE_VALUES = {
    "dispatch_simdgroups_per_threadgroup": "id.simdgroups_per_threadgroup",
    "dispatch_threads_per_threadgroup": _uint3("dispatch_threads_per_threadgroup"),
    "grid_origin": "uint3{0, 0, 0}",
    "grid_size": _uint3("threads_per_grid"),
    "simdgroup_index_in_threadgroup": "id.simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup": "id.simdgroups_per_threadgroup",
    "thread_execution_width": "32u",
    "thread_index_in_simdgroup": "id.thread_index_in_simdgroup",
    "thread_index_in_threadgroup": "id.thread_index_in_threadgroup",
    "thread_position_in_grid": _uint3("thread_position_in_grid"),
    "thread_position_in_threadgroup": _uint3("thread_position_in_threadgroup"),
    "threadgroup_position_in_grid": _uint3("threadgroup_position_in_grid"),
    "threadgroups_per_grid": _uint3("threadgroups_per_grid"),
    "threads_per_grid": _uint3("threads_per_grid"),
    "threads_per_simdgroup": "id.threads_per_simdgroup",
    "threads_per_threadgroup": _uint3("threads_per_threadgroup"),
}

# `threadgroup T name[N];` in a kernel body: one array shared by the lanes of
# a threadgroup. Lanes of one threadgroup share an OS thread, threadgroups
# run on different ones: a static thread_local is exactly that sharing.
THREADGROUP_ARRAY = re.compile(r"^(\s*)threadgroup\s+(\w+)\s+(\w+)\s*\[(.*)\]\s*;\s*$")


class ClangMissing(RuntimeError):
    pass


MISSING_COMPILER = (
    "clang++ not found: the Metal emulator compiles the kernels with clang "
    "(Debian: apt-get install clang; or set FLASHATTN_EMULATOR_CXX)"
)


def find_compiler() -> str | None:
    """The C++ compiler the emulator uses, or None when there is none."""
    return os.environ.get("FLASHATTN_EMULATOR_CXX") or shutil.which("clang++")


def _compiler() -> str:
    cxx = find_compiler()
    if not cxx:
        raise ClangMissing(MISSING_COMPILER)
    return cxx


def _body(body: str) -> str:
    lines = []
    for line in body.splitlines():
        m = THREADGROUP_ARRAY.match(line)
        if m:
            indent, ty, name, size = m.groups()
            line = (
                f"{indent}static thread_local threadgroup {ty} {name}[{size}];\n"
                f"{indent}::fa_emu::register_threadgroup_memory((void*){name}, sizeof({name}));"
            )
        elif re.search(r"\bthreadgroup\s+\w+\s+\w+\s*\[", line):
            raise ValueError(f"threadgroup array the emulator cannot rewrite: {line.strip()}")
        lines.append(line)
    return "\n".join(lines)


def _instance_source(index: int, kernel: dict, inst: dict) -> str:
    """One instance as MLX would write it, plus the lane function that calls it."""
    params = ", ".join(f"{kind} {name}" for name, kind in inst["template_params"])
    args, calls = [], []
    names = kernel["inputs"] + kernel["outputs"]
    types = inst["input_types"] + inst["output_types"]
    for i, (name, ty) in enumerate(zip(names, types)):
        space = "const device" if i < len(kernel["inputs"]) else "device"
        args.append(f"    {space} {ty}* {name} [[buffer({i})]]")
        calls.append(f"({space} {ty}*)b[{i}]")
    for attr, ty in ATTRIBUTES:
        if attr in kernel["body"]:
            if attr not in LANE_VALUES:
                raise ValueError(f"the emulator does not model [[{attr}]]")
            args.append(f"    {ty} {attr} [[{attr}]]")
            calls.append(LANE_VALUES[attr])
    template_args = inst["name"][inst["name"].index("<"):] if params else ""
    signature = ",\n".join(args)
    return (
        f"// {inst['name']}\n"
        + (f"template <{params}>\n" if params else "")
        + f"[[kernel]] void fa_kernel_{index}(\n{signature}) {{\n{_body(kernel['body'])}\n}}\n\n"
        f"void fa_lane_{index}(void* const* b, const fa_emu::LaneIds& id) {{\n"
        f"  fa_kernel_{index}{template_args}(\n      " + ",\n      ".join(calls) + ");\n}\n\n"
    )


def generate(metal: dict) -> dict[str, str]:
    """The generated translation units: one per kernel, and the table."""
    kernels = {k["name"]: k for k in metal["kernels"]}
    prologue = (
        "// Generated by tests/metal_emulator/build.py from flashattn-core's Metal source.\n"
        '#include "instances.h"\n#include <metal_stdlib>\n\n' + metal["source"] + "\n\n"
    )
    units: dict[str, list[str]] = {}
    table, decls = [], []
    for i, inst in enumerate(metal["instances"]):
        kernel = kernels[inst["kernel"]]
        units.setdefault(inst["kernel"], [prologue]).append(_instance_source(i, kernel, inst))
        names = kernel["inputs"] + kernel["outputs"]
        types = inst["input_types"] + inst["output_types"]
        decls.append(
            f"void fa_lane_{i}(void* const* b, const fa_emu::LaneIds& id);\n"
            f"static const char* const fa_types_{i}[] = {{{', '.join(map(_quote, types))}}};\n"
            f"static const char* const fa_names_{i}[] = {{{', '.join(map(_quote, names))}}};\n"
        )
        table.append(
            f"    {{{_quote(inst['name'])}, fa_lane_{i}, {len(kernel['inputs'])}, "
            f"{len(kernel['outputs'])}, fa_types_{i}, fa_names_{i}}},\n"
        )
    sources = {f"kernels_{name}.cpp": "".join(parts) for name, parts in units.items()}
    sources["table.cpp"] = (
        '#include "instances.h"\n\n' + "".join(decls) + "\nnamespace fa_emu {\n"
        "extern const Instance kInstances[] = {\n" + "".join(table) + "};\n"
        f"extern const int kInstanceCount = {len(table)};\n}}  // namespace fa_emu\n"
    )
    return sources


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "flashattn-mlx" / "metal-emulator"


def build(metal: dict, cache: Path | None = None) -> Path:
    """The emulator library for these kernels: from the cache, or compiled."""
    cxx = _compiler()
    sources = generate(metal)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for part in [version, " ".join(FLAGS), *sources.values()]:
        digest.update(part.encode())
    for name in HAND_WRITTEN:
        digest.update((HERE / name).read_bytes())
    digest.update((ABI_DIR / "emulator_abi.h").read_bytes())
    target = (cache or _cache_dir()) / f"metal-emulator-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="metal-emulator-") as tmp:
        tmp = Path(tmp)
        for name, text in sources.items():
            (tmp / name).write_text(text)
        includes = [f"-I{HERE / 'include'}", f"-I{HERE}", f"-I{ABI_DIR}"]
        units = [tmp / n for n in sources] + [HERE / n for n in RUNTIME_SOURCES]

        def compile_one(src: Path) -> Path:
            obj = tmp / (src.stem + ".o")
            done = subprocess.run(
                [cxx, *FLAGS, *includes, "-c", str(src), "-o", str(obj)], capture_output=True, text=True
            )
            if done.returncode != 0:
                raise RuntimeError(f"clang++ failed on {src.name}:\n{done.stderr[-6000:]}")
            return obj

        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
            objects = list(pool.map(compile_one, units))
        partial = tmp / "emulator.so"
        done = subprocess.run(
            [cxx, "-shared", "-pthread", *map(str, objects), "-o", str(partial)], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"linking the emulator failed:\n{done.stderr[-4000:]}")
        staged = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        shutil.copyfile(partial, staged)
        os.replace(staged, target)  # atomic: another process never loads half a file
    return target


class EmulatorError(RuntimeError):
    """A launch the emulator refused or a kernel that misbehaved."""


class _Buffer(ctypes.Structure):  # FaEmuBuffer (emulator_abi.h)
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("elements", ctypes.c_int64),
        ("bytes", ctypes.c_int64),
        ("dtype", ctypes.c_char_p),
    ]


MSL_TYPES = {"float32": "float", "int32": "int32_t", "int64": "int64_t", "uint8": "uint8_t"}


@dataclass
class Emulator:
    """The loaded emulator: runs flash_attention through the Metal dispatch and
    kernels on the CPU stream."""

    library: ctypes.CDLL
    path: Path

    @property
    def address(self) -> int:
        return ctypes.cast(self.library.fa_metal_emulate, ctypes.c_void_p).value

    def run(self, instance, inputs, outputs, grid, threadgroup, order="forward", seed=0):
        """Runs one kernel instance on NumPy arrays. outputs: (shape, dtype)
        pairs. Returns the output arrays; raises EmulatorError."""
        import numpy as np

        arrays = [np.ascontiguousarray(a) for a in inputs] + [np.zeros(s, d) for s, d in outputs]
        buffers = (_Buffer * len(arrays))(
            *[_Buffer(a.ctypes.data, a.size, a.nbytes, MSL_TYPES[a.dtype.name].encode()) for a in arrays]
        )
        error = ctypes.create_string_buffer(1024)
        rc = self.library.fa_metal_emulate(
            instance.encode(), buffers, len(inputs), len(outputs),
            (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*threadgroup),
            {"forward": 0, "reverse": 1, "shuffled": 2}[order], ctypes.c_ulonglong(seed), error, len(error),
        )
        if rc != 0:
            raise EmulatorError(error.value.decode())
        return arrays[len(inputs):]

    def attention(self, q, k, v, *, scale=None, mask=None, window=None, kernel="auto", splits=0, order="shuffled",
                  seed=0, group_size=None, bits=None, sinks=None, dtype=None, out_dtype=None):
        from flashattn_core import _ext

        lane_order = {"forward": 0, "reverse": 1, "shuffled": 2}[order]
        return _ext._metal_emulated(
            q, k, v, scale=scale, mask=mask, emulator=self.address, kernel=kernel, splits=splits,
            lane_order=lane_order, seed=seed, window=window, group_size=group_size, bits=bits, sinks=sinks,
            dtype=dtype, out_dtype=out_dtype,
        )


def load(metal: dict | None = None) -> Emulator:
    """Build (or find in the cache) and load the emulator for the installed
    flashattn-core, or for the given kernels (`_ext._metal_kernels()` form)."""
    if metal is None:
        from flashattn_core import _ext

        metal = _ext._metal_kernels()
    path = build(metal)
    library = ctypes.CDLL(str(path))
    library.fa_metal_emulate.restype = ctypes.c_int
    return Emulator(library, path)
