"""Runs flashattn-core's Metal kernels on the CPU, for the Linux test suite
(README.md says how and what it cannot catch)."""

from .build import ClangMissing, Emulator, EmulatorError, generate, load

__all__ = ["ClangMissing", "Emulator", "EmulatorError", "generate", "load"]
