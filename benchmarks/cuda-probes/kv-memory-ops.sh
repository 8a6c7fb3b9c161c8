#!/usr/bin/env bash
# Whether the default float32 attention's extra peak memory on a 16K prompt
# over a 4-bit cache is MLX's CUDA backend keeping the arrays of enqueued
# kernels alive: the same three settings as `cuda-check kv` (4-bit cache
# with the patch's float32 attention, 4-bit native, bfloat16 cache off) with
# MLX's command buffers at its default size for the GPU (100 operations on
# Hopper; at most 10 buffers in flight) and at smaller ones
# (MLX_MAX_OPS_PER_BUFFER); WARMUP=1: the peak of a second prompt, after one
# unmeasured (cuDNN's plans for the patch off made by then). Run after a
# build (cuda-check none); needs .gpu2/.
set -uo pipefail
OUT="${OUT:-/tmp/flashattn-cuda}"
python3 scripts/random-model.py .gpu2 /tmp/qwen2-kv --dtype bfloat16 >/dev/null
common=(--model /tmp/qwen2-kv -p 16384 -g 0 --trials 1 --warmup "${WARMUP:-0}" --prompt-repeats 1 --json)
for round in $(seq 1 "${ROUNDS:-1}"); do
  for ops in ${OPS_LIST:-default 20}; do
    limit=(); [ "$ops" != default ] && limit=("MLX_MAX_OPS_PER_BUFFER=$ops")
    env "${limit[@]}" python3 -m flash_eval throughput "${common[@]}" --kv-bits 4 --patch on \
      > "$OUT/mem-$round-$ops-4bit-float32.json" 2>> "$OUT/mem.err"
    env "${limit[@]}" python3 -m flash_eval throughput "${common[@]}" --kv-bits 4 --patch on --precision native \
      > "$OUT/mem-$round-$ops-4bit-native.json" 2>> "$OUT/mem.err"
    env "${limit[@]}" python3 -m flash_eval throughput "${common[@]}" --patch off \
      > "$OUT/mem-$round-$ops-bf16-off.json" 2>> "$OUT/mem.err"
  done
done
tail -5 "$OUT/mem.err"
python3 - "$OUT"/mem-*.json <<'PY'
import json, os, sys
for path in sys.argv[1:]:
    d = json.load(open(path))
    for r in d["results"]:
        print(f"{os.path.basename(path)[4:-5]:26s} peak {r['peak_memory']:.3f} GB prompt {r.get('prompt_tps', 0):8.0f} tok/s "
              f"calls {r.get('flash_calls', '-')} fallbacks {r.get('fallbacks', {})}")
PY
