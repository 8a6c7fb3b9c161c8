"""flash-eval across processes with MLX's own distributed layer: run a model
command under `mlx.launch` (ring backend on CPUs, NCCL on CUDA GPUs) and the
work is split across ranks, the sums are combined with mx.distributed, and
only rank 0 reports. Without mlx.launch the group has one member and nothing
changes."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass
class Ranks:
    group: object

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.size > 1:
            mx.eval(mx.distributed.all_sum(mx.array(1.0), group=self.group))

    def sum64(self, values) -> np.ndarray:
        """Sum over ranks of float64 values, to ~1e-14 relative: each rank's
        values travel as two float32 (hi + lo; GPUs have no float64), are
        gathered, and are added in float64 here (a float32 all_sum would round
        the sum of the hi parts)."""
        x = np.asarray(values, dtype=np.float64)
        if self.size == 1:
            return x
        hi = x.astype(np.float32)
        lo = (x - hi.astype(np.float64)).astype(np.float32)
        parts = mx.distributed.all_gather(mx.array(np.stack([hi, lo])[None]), group=self.group)
        parts = np.array(parts, dtype=np.float64)  # (ranks, 2, n)
        return parts[:, 0].sum(axis=0) + parts[:, 1].sum(axis=0)

    def union(self, names) -> list[str]:
        """The sorted union of every rank's names (such as the fallback
        reasons each counted), the same list on every rank. The names travel
        as their UTF-8 bytes, one per float32, newline-separated and padded
        with zeros to the longest rank's."""
        names = sorted(set(names))
        if self.size == 1:
            return names
        blob = np.frombuffer("\n".join(names).encode(), dtype=np.uint8)
        width = int(self.max([blob.size])[0])
        if width == 0:
            return []
        padded = np.zeros((1, width), dtype=np.float32)
        padded[0, : blob.size] = blob
        rows = np.array(mx.distributed.all_gather(mx.array(padded), group=self.group)).astype(np.uint8)
        gathered = (bytes(row).rstrip(b"\0").decode().split("\n") for row in rows)
        return sorted({n for row in gathered for n in row if n})

    def max(self, values) -> np.ndarray:
        x = np.asarray(values, dtype=np.float32)
        if self.size == 1:
            return x.astype(np.float64)
        return np.array(mx.distributed.all_max(mx.array(x), group=self.group), dtype=np.float64)


def init() -> Ranks:
    return Ranks(mx.distributed.init())
