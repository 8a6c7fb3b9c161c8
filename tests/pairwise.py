"""A covering array of strength two: every pair of values of every two
parameters appears in at least one row, in far fewer rows than the Cartesian
product. Greedy and seeded, so the rows are the same on every run."""

from __future__ import annotations

import itertools
import random
from typing import Callable


def pairwise(
    params: dict[str, list],
    accept: Callable[[dict], bool] = lambda row: True,
    seed: int = 0,
    candidates: int = 40,
) -> list[dict]:
    names = list(params)
    uncovered = {
        (a, ia, b, ib)
        for a, b in itertools.combinations(names, 2)
        for ia in range(len(params[a]))
        for ib in range(len(params[b]))
    }
    rng = random.Random(seed)
    rows: list[dict[str, int]] = []

    def pairs_of(row: dict[str, int]):
        return {
            (a, row[a], b, row[b])
            for a, b in itertools.combinations(names, 2)
            if a in row and b in row
        }

    while uncovered:
        best, best_gain = None, 0
        pool = sorted(uncovered, key=repr)
        for _ in range(candidates):
            a, ia, b, ib = rng.choice(pool)
            row = {a: ia, b: ib}
            for name in rng.sample(names, len(names)):
                if name in row:
                    continue
                options = list(range(len(params[name])))
                rng.shuffle(options)
                row[name] = max(
                    options,
                    key=lambda i: len(pairs_of({**row, name: i}) & uncovered),
                )
            values = {n: params[n][i] for n, i in row.items()}
            gain = len(pairs_of(row) & uncovered)
            if accept(values) and gain > best_gain:
                best, best_gain = row, gain
        if best is None:
            raise ValueError("no acceptable row covers the remaining pairs")
        uncovered -= pairs_of(best)
        rows.append(best)
    return [{n: params[n][i] for n, i in row.items()} for row in rows]
