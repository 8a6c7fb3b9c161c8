"""flash_attention against MLX's SDPA in alternating 2-second phases (bfloat16,
causal prefill on the target shapes), with the GPU's SM clock and power
sampled every 50 ms by nvidia-smi: whether a difference in per-call time
comes with a difference in clocks (a kernel that draws more power runs at a
lower clock under the board's power limit). Per-call times: 20 calls an
evaluation, median over the phase. python3 scripts/power-probe.py [out_dir]"""

import csv
import datetime
import os
import statistics
import subprocess
import sys
import time

import mlx.core as mx
from gpu_probe_calls import HD128, QWEN05B, calls

CASES = [("qwen05b causal 8K", QWEN05B, 8192), ("hd128 causal 4K", HD128, 4096)]
PHASE_S, ROUNDS, BATCH = 2.0, 3, 20


def phase(fn):
    """Per-call seconds of each batch for PHASE_S; wall-clock start and end."""
    start, per = time.time(), []
    while time.time() - start < PHASE_S:
        t = time.perf_counter()
        mx.eval([fn() for _ in range(BATCH)])
        mx.synchronize()
        per.append((time.perf_counter() - t) / BATCH)
    return start, time.time(), per


def samples(path):
    """(unix time, SM MHz, watts) rows of nvidia-smi's log."""
    rows = []
    with open(path) as f:
        for r in csv.reader(f):
            if len(r) < 3:
                continue
            try:
                ts = datetime.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
                rows.append((ts, float(r[1]), float(r[2])))
            except ValueError:
                continue
    return rows


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
    os.makedirs(out, exist_ok=True)
    log_path = os.path.join(out, "smi.csv")
    with open(log_path, "w") as log:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                "-lms", "50"], stdout=log)
        phases = []
        try:
            for name, heads, L in CASES:
                flash, mlx = calls(heads, L, L, mx.bfloat16)
                impls = {"flash": flash, "mlx": mlx}
                for fn in impls.values():
                    phase(fn)  # warm-up, untimed
                for r in range(ROUNDS):
                    order = ["flash", "mlx"] if r % 2 == 0 else ["mlx", "flash"]
                    for impl in order:
                        phases.append((name, impl, *phase(impls[impl])))
        finally:
            time.sleep(0.2)
            smi.terminate()
            smi.wait()
    rows = samples(log_path)
    print(f"{'case':20s} {'impl':6s} {'ms/call':>8s} {'SM MHz':>7s} {'W':>6s}")
    for name, impl, t0, t1, per in phases:
        inside = [r for r in rows if t0 + 0.2 <= r[0] <= t1]  # the phase's first 0.2 s left out
        mhz = statistics.mean(r[1] for r in inside) if inside else float("nan")
        watts = statistics.mean(r[2] for r in inside) if inside else float("nan")
        print(f"{name:20s} {impl:6s} {statistics.median(per) * 1e3:8.3f} {mhz:7.0f} {watts:6.0f}")


if __name__ == "__main__":
    main()
