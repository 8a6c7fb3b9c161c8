"""The flash-eval command line."""

from __future__ import annotations

import sys

import click

from . import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="flash-eval")
def main():
    """Measure flashattn-core and mlxlm-flash-patch against MLX's own attention."""


def _register():
    from .demo import demo
    from .kernel import kernel
    from .model_cmd import model
    from .perplexity import perplexity
    from .throughput import throughput
    from .train import train

    for command in (demo, kernel, model, perplexity, throughput, train):
        main.add_command(command)


_register()

# Model-level runs on Linux get an optimised BLAS preloaded (Debian's OpenBLAS,
# else MKL from the mkl wheel; see blas.py); the kernel benchmark keeps MLX's
# BLAS as installed.
MODEL_COMMANDS = {"perplexity", "throughput", "train"}


def entry():
    """The console script: main() after the BLAS check."""
    from . import blas

    argv = sys.argv[1:]
    if argv and argv[0] in MODEL_COMMANDS:
        blas.maybe_reexec(argv)
    main(prog_name="flash-eval")
