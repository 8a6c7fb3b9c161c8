"""The causal rule with its sliding window as the CUDA kernels and their
launch model share it (packages/flashattn-core/csrc/cuda/kernels/causal.h,
plain C++): compiled here with the host compiler and checked exhaustively on
small sizes against the definition (row r of L sees key c of S iff
0 <= r + S - L - c < window): which keys a row sees, the key range a row
tile walks, the rows a key tile's backward walks, and which tiles need the
per-element mask. On a GPU the kernels themselves are tested (tests/gpu)."""

import pathlib
import shutil
import subprocess

import pytest

HEADER = pathlib.Path(__file__).parents[2] / "packages/flashattn-core/csrc/cuda/kernels/causal.h"
NO_WINDOW = 0x7FFFFFFF
SIZES = range(1, 9)
WINDOWS = list(range(1, 11)) + [NO_WINDOW]
ROWS, KEYS = (1, 2, 3, 4), (1, 2, 3, 5)

DRIVER = r"""
#include <cstdio>
#include "causal.h"
int main() {
  const int windows[] = {%(windows)s};
  const int rows[] = {1, 2, 3, 4}, keys[] = {1, 2, 3, 5};
  for (int L = 1; L <= 8; ++L) for (int S = 1; S <= 8; ++S) for (int W : windows) {
    const int off = fa::causal_offset(L, S);
    std::printf("case %%d %%d %%d\nhides ", L, S, W);
    for (int r = 0; r < L + 2; ++r) for (int c = 0; c < S + 2; ++c) std::printf("%%d", fa::causal_hides(r, c, off, W));
    std::printf("\nkv");
    for (int R : rows) for (int l0 = 0; l0 < L; l0 += R)
      std::printf(" %%d,%%d", fa::causal_kv_begin(l0, L, S, W), fa::causal_kv_end(l0, R, L, S));
    std::printf("\nrows");
    for (int K : keys) for (int c0 = 0; c0 < S; c0 += K)
      std::printf(" %%d,%%d", fa::causal_row_begin(c0, L, S), fa::causal_row_end(c0, K, L, S, W));
    std::printf("\ntiles ");
    for (int R : rows) for (int K : keys) for (int r0 = 0; r0 + R <= L; ++r0) for (int c0 = 0; c0 + K <= S; ++c0)
      std::printf("%%d", fa::causal_tile_hides(r0, R, c0, K, off, W));
    std::printf("\n");
  }
}
"""


CXX = next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
pytestmark = pytest.mark.skipif(CXX is None, reason="needs a C++ compiler (c++, g++ or clang++) to build causal.h")


@pytest.fixture(scope="module")
def helpers(tmp_path_factory):
    work = tmp_path_factory.mktemp("causal_rule")
    (work / "driver.cpp").write_text(DRIVER % {"windows": ", ".join(map(str, WINDOWS))})
    subprocess.run([CXX, "-std=c++17", "-O1", f"-I{HEADER.parent}", "-o", str(work / "driver"),
                    str(work / "driver.cpp")], check=True)
    out = subprocess.run([str(work / "driver")], check=True, capture_output=True, text=True).stdout
    cases = {}
    lines = out.splitlines()
    for i in range(0, len(lines), 5):
        L, S, W = map(int, lines[i].split()[1:])
        cases[L, S, W] = {
            "hides": lines[i + 1].split()[1] if len(lines[i + 1].split()) > 1 else "",
            "kv": [tuple(map(int, p.split(","))) for p in lines[i + 2].split()[1:]],
            "rows": [tuple(map(int, p.split(","))) for p in lines[i + 3].split()[1:]],
            "tiles": lines[i + 4].split()[1] if len(lines[i + 4].split()) > 1 else "",
        }
    assert len(cases) == len(SIZES) ** 2 * len(WINDOWS)
    return cases


def sees(r, c, L, S, W):
    return 0 <= r + S - L - c < W


def all_cases():
    return [(L, S, W) for L in SIZES for S in SIZES for W in WINDOWS]


def test_which_keys_a_row_sees(helpers):
    for L, S, W in all_cases():
        want = "".join(str(int(not sees(r, c, L, S, W))) for r in range(L + 2) for c in range(S + 2))
        assert helpers[L, S, W]["hides"] == want, (L, S, W)


def tile_ranges(helpers, name, tile_sizes, along_keys):
    """Each case's tiles (of rows, or along_keys of keys) with the [begin,
    end) the helper wrote for them under `name`, in the helper's order."""
    for L, S, W in all_cases():
        got = iter(helpers[L, S, W][name])
        for T in tile_sizes:
            for t0 in range(0, S if along_keys else L, T):
                yield (L, S, W), T, t0, *next(got)


def test_a_row_tile_walks_every_key_its_rows_see_and_starts_at_the_first(helpers):
    for (L, S, W), R, l0, begin, end in tile_ranges(helpers, "kv", ROWS, along_keys=False):
        seen = [c for r in range(l0, min(l0 + R, L)) for c in range(S) if sees(r, c, L, S, W)]
        assert all(begin <= c < end for c in seen), (L, S, W, R, l0, begin, end)
        first_row = [c for c in range(S) if sees(l0, c, L, S, W)]
        if first_row:
            assert begin == first_row[0], (L, S, W, R, l0)
        last_row = [c for c in range(S) if sees(min(l0 + R, L) - 1, c, L, S, W)]
        if last_row:
            assert end == last_row[-1] + 1, (L, S, W, R, l0)


def test_a_key_tile_walks_every_row_that_sees_its_keys(helpers):
    for (L, S, W), K, c0, begin, end in tile_ranges(helpers, "rows", KEYS, along_keys=True):
        rows = [r for r in range(L) for c in range(c0, min(c0 + K, S)) if sees(r, c, L, S, W)]
        assert all(begin <= r < end for r in rows), (L, S, W, K, c0, begin, end)
        if rows:  # from the first row that sees the tile's first key, to the last that sees its last
            assert end == max(rows) + 1, (L, S, W, K, c0)


def test_a_tile_needs_the_mask_exactly_when_some_row_misses_some_key(helpers):
    for L, S, W in all_cases():
        want = "".join(
            str(int(not all(sees(r, c, L, S, W) for r in range(r0, r0 + R) for c in range(c0, c0 + K))))
            for R in ROWS for K in KEYS for r0 in range(L - R + 1) for c0 in range(S - K + 1))
        assert helpers[L, S, W]["tiles"] == want, (L, S, W)
