"""Runs flashattn-core's Metal kernels on the CPU, for the Linux test suite
(README.md says how and what it cannot catch)."""

from .build import MISSING_COMPILER, ClangMissing, Emulator, EmulatorError, find_compiler, generate, load

__all__ = [
    "MISSING_COMPILER", "ClangMissing", "Emulator", "EmulatorError", "find_compiler", "generate", "load",
]
