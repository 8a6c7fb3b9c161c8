// A small persistent pool of worker threads for the CPU kernels.
//
// MLX runs each CPU stream's work on one thread; the kernels spread one
// primitive over all cores from there. Workers are started on first use,
// sleep between calls, and are forgotten in a forked child (which has no
// threads but the forking one).

#pragma once

#include <cstddef>
#include <functional>

namespace flashattn::cpu {

// Workers the pool would use, the calling thread included: the
// FLASHATTN_NUM_THREADS environment variable, or the CPUs this process may
// run on.
int pool_size();

// Calls body(worker) on `workers` threads at once (the caller is worker 0)
// and returns when all are done. If another call holds the pool, the body
// runs on the caller alone (worker 0) instead of waiting.
void parallel_run(int workers, const std::function<void(int)>& body);

// This thread's scratch buffer, at least `bytes` long (grown, never shrunk):
// the kernels' per-worker tiles.
void* thread_scratch(size_t bytes);

} // namespace flashattn::cpu
