#!/usr/bin/env bash
# Where a LoRA step's GPU time goes, patch off against on (PyTorch's
# profiler, train-step-probe.py): kernel time a step by kernel, both settings side by
# side, largest differences first. After `scripts/cuda-check none` (the
# build) with .gpu2 carried:
#   [COMPILE=1] bash benchmarks/cuda-probes/train-step-profile.sh [native|float32] [length]
# (COMPILE=1: the step compiled, as flash-eval train and mlx_lm.lora run it)
set -uo pipefail
precision="${1:-native}"; length="${2:-8192}"; steps="${STEPS:-3}"
OUT="${OUT:-/tmp/train-profile}"; mkdir -p "$OUT"
here="$(cd "$(dirname "$0")" && pwd)"
[ -d /tmp/qwen2-train ] || python3 scripts/random-model.py .gpu2 /tmp/qwen2-train --dtype bfloat16 >/dev/null
for patch in off on; do
  STEPS="$steps" python3 "$here/train-step-probe.py" /tmp/qwen2-train "$patch" "$precision" "$length" \
    "$OUT/kern-$precision-$patch.tsv" > "$OUT/probe-$patch.log" 2>&1 || { tail -5 "$OUT/probe-$patch.log"; exit 1; }
  grep -E "wall|busy" "$OUT/probe-$patch.log"
done
python3 - "$OUT" "$precision" <<'PY'
import sys
out, precision = sys.argv[1], sys.argv[2]
def load(patch):
    rows = {}
    for line in open(f"{out}/kern-{precision}-{patch}.tsv"):
        t, n, name = line.rstrip("\n").split("\t", 2)
        name = name[:90]
        a, b = rows.get(name, (0.0, 0))
        rows[name] = (a + float(t), b + int(n))
    return rows
off, on = load("off"), load("on")
print(f"GPU ms a step: off {sum(t for t, _ in off.values()):.2f}, on {sum(t for t, _ in on.values()):.2f}")
names = sorted(set(off) | set(on), key=lambda k: -abs(on.get(k, (0, 0))[0] - off.get(k, (0, 0))[0]))
print(f"{'off ms':>8s} {'n':>5s} {'on ms':>8s} {'n':>5s}  kernel")
for k in names[:25]:
    a, b = off.get(k, (0, 0)), on.get(k, (0, 0))
    print(f"{a[0]:8.3f} {a[1]:5d} {b[0]:8.3f} {b[1]:5d}  {k}")
PY
