"""Many threads at once, many calls in a row, and the O(L + S) memory bound."""

import threading

import mlx.core as mx
import numpy as np
from attention_cases import Case, make_inputs

from flashattn_core import flash_attention
from flashattn_core.reference import attention_reference, relative_error


def test_eight_threads_at_once_on_different_inputs():
    cases = [Case(batch=(1,), heads=(4, 2), L=20 + 7 * i, S=300 + 11 * i, E=16 + 8 * (i % 3),
                  mask=["causal", "none", "bool_LS", "additive_LS"][i % 4]) for i in range(8)]
    inputs = [make_inputs(c, seed=i) for i, c in enumerate(cases)]
    errors = [None] * 8
    barrier = threading.Barrier(8)

    def work(i):
        q, k, v, mask = inputs[i]
        # Each thread gets its own MLX stream, as threads that run models do.
        stream = mx.new_stream(mx.cpu)
        barrier.wait()
        for _ in range(5):
            out = flash_attention(q, k, v, mask=mask, stream=stream)
            mx.eval(out)
        errors[i] = relative_error(out, attention_reference(q, k, v, mask=mask))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(e is not None and e <= 2e-5 for e in errors), errors


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_ten_thousand_calls_keep_memory_flat():
    q = mx.random.normal((1, 4, 8, 32), key=mx.random.key(0))
    k = mx.random.normal((1, 2, 64, 32), key=mx.random.key(1))
    mx.eval(q, k)
    for _ in range(500):  # warm up pools and caches
        mx.eval(flash_attention(q, k, k, mask="causal"))
    rss, active = rss_bytes(), mx.get_active_memory()
    for _ in range(10_000):
        mx.eval(flash_attention(q, k, k, mask="causal"))
    assert mx.get_active_memory() - active <= 64 * 1024
    assert rss_bytes() - rss <= 8 * 2**20


def test_long_sequence_memory_is_linear():
    L = S = 16384  # one L x S float32 matrix per head would be 1 GiB
    q = mx.random.normal((1, 1, L, 64), key=mx.random.key(0))
    k = mx.random.normal((1, 1, S, 64), key=mx.random.key(1))
    mx.eval(q, k)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = flash_attention(q, k, k, mask="causal")
    mx.eval(out)
    assert mx.get_peak_memory() - before <= out.nbytes + (1 << 20)
    assert not np.isnan(np.array(out[0, 0, ::4096])).any()
