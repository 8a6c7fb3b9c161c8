"""The patch's reading of mlx-lm's sliding-window masks: a boolean (L, S)
mask that is exactly the causal band of some window becomes
``mask="causal", window=W`` (a band wide enough to hide nothing: plain
"causal"); anything else stays the mask it is."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask

from mlxlm_flash_patch import windows


@pytest.mark.parametrize("N, offset, window", [(17, 0, 8), (5, 7, 8), (64, 1000, 300), (3, 2, 1), (40, 0, 39)])
def test_mlx_lm_bands_become_windows(N, offset, window):
    assert windows.as_window(create_causal_mask(N, offset, window_size=window)) == ("causal", window)


@pytest.mark.parametrize("N, offset, window", [(17, 0, None), (5, 7, 12), (8, 0, 8), (6, 10, 50)])
def test_bands_that_hide_nothing_more_are_causal(N, offset, window):
    assert windows.as_window(create_causal_mask(N, offset, window_size=window)) == ("causal", None)


def test_other_masks_stay_as_they_are():
    band = np.array(create_causal_mask(12, 4, window_size=5))
    nudged = band.copy()
    nudged[3, 2] = not nudged[3, 2]  # one key off the band
    padded = create_causal_mask(12, 4, window_size=5, left_padding=mx.array([2]))  # (1, 1, 12, 16)
    for mask in (mx.array(nudged), padded, mx.array(band.astype(np.float32)), "causal", None,
                 mx.array(np.ones((16, 12), dtype=bool)), mx.zeros((0, 4), dtype=mx.bool_)):
        assert windows.as_window(mask) is None


def test_a_mask_is_read_once(monkeypatch):
    mask = create_causal_mask(20, 5, window_size=6)
    calls = []
    classify = windows._classify
    monkeypatch.setattr(windows, "_classify", lambda m: calls.append(m) or classify(m))
    for _ in range(4):  # every layer of one forward pass
        assert windows.as_window(mask) == ("causal", 6)
    other = create_causal_mask(20, 5, window_size=6)
    assert windows.as_window(other) == ("causal", 6)
    assert len(calls) == 2
