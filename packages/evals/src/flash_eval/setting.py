"""The patch setting a measurement runs under, "off" or "on", whatever the
patch's state was before (restored afterwards)."""

from __future__ import annotations

import mlxlm_flash_patch


class _Off:
    def __enter__(self):
        self.was = mlxlm_flash_patch.precision()
        mlxlm_flash_patch.disable()

    def __exit__(self, *exc):
        if self.was:
            mlxlm_flash_patch.enable(self.was)
        return False


def patch_setting(patch: str, precision: str):
    """A fresh context manager for one use."""
    return mlxlm_flash_patch.patched(precision) if patch == "on" else _Off()
