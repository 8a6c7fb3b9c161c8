import pytest

import mlxlm_flash_patch


@pytest.fixture(autouse=True)
def patch_off():
    """Every test starts and ends with the patch off and fresh statistics."""
    mlxlm_flash_patch.disable()
    mlxlm_flash_patch.reset_stats()
    yield
    mlxlm_flash_patch.disable()
