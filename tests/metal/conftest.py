import pytest

import metal_emulator


@pytest.fixture(scope="session")
def emulator():
    """The Metal emulator for the installed flashattn-core (compiled once,
    then cached)."""
    return metal_emulator.load()
