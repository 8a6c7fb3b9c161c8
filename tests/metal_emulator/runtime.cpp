// The emulator's runtime: every lane of a threadgroup is a fiber with its own
// stack, all fibers of one threadgroup share one OS thread, and a scheduler
// runs them from one synchronisation point to the next:
//
//   1. resume every ready lane (in the chosen order) until it blocks at a
//      SIMD-group operation or a threadgroup barrier, or returns;
//   2. a SIMD group whose live lanes all wait at the same operation gets its
//      result (sum, max, shuffle, matrix product) and runs again;
//   3. otherwise, when every live lane waits at the threadgroup barrier, all
//      run again; anything else is a deadlock on hardware, reported as such.
//
// Threadgroups are independent, so several run at once on different OS
// threads, each with its own fibers and its own threadgroup memory.

#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700  // macOS hides ucontext without it
#endif

#include "runtime.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace fa_emu {

namespace {

constexpr int kSimdWidth = 32;
constexpr unsigned kMaxThreadsPerThreadgroup = 1024;  // Apple GPUs
constexpr size_t kMaxThreadgroupMemory = 32768;       // bytes, Apple GPUs
constexpr size_t kStackBytes = 128 * 1024;

///////////////////////////////////////////////////////////////////////////////
// Fibers: a saved stack pointer per lane (x86-64), ucontext elsewhere.
///////////////////////////////////////////////////////////////////////////////

#if defined(__x86_64__)
// Saves the callee-saved registers on the current stack, stores the stack
// pointer in *save, and resumes the fiber whose stack pointer is `load`.
extern "C" void fa_emu_switch(void** save, void* load);
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".globl fa_emu_switch\n"
    ".hidden fa_emu_switch\n"
    ".type fa_emu_switch,@function\n"
    "fa_emu_switch:\n"
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n"
    ".size fa_emu_switch,.-fa_emu_switch\n");

struct Context {
  void* sp = nullptr;
};

void start_context(Context& c, char* stack, size_t bytes, void (*entry)()) {
  auto top = reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t(15);
  auto* slot = reinterpret_cast<void**>(top);
  slot[-1] = nullptr;                           // entry's return address
  slot[-2] = reinterpret_cast<void*>(entry);    // fa_emu_switch returns here
  for (int i = 3; i <= 8; ++i) slot[-i] = nullptr;  // rbp rbx r12-r15
  c.sp = slot - 8;
}

inline void switch_context(Context& from, Context& to) {
  fa_emu_switch(&from.sp, to.sp);
}
#else
struct Context {
  ucontext_t uc;
};

void start_context(Context& c, char* stack, size_t bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}

inline void switch_context(Context& from, Context& to) {
  swapcontext(&from.uc, &to.uc);
}
#endif

// Stacks are reused across launches: a pool of mmap'ed regions, each with a
// guard page below, so a lane that overflows its stack faults at once.
class StackPool {
 public:
  char* take() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        char* s = free_.back();
        free_.pop_back();
        return s;
      }
    }
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    void* p = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      std::fprintf(stderr, "metal emulator: cannot map a lane stack\n");
      std::abort();
    }
    mprotect(p, page, PROT_NONE);
    return static_cast<char*>(p) + page;
  }
  void give_back(const std::vector<char*>& stacks) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.insert(free_.end(), stacks.begin(), stacks.end());
  }

 private:
  std::mutex mu_;
  std::vector<char*> free_;
};

StackPool& stack_pool() {
  static StackPool* pool = new StackPool;  // never destroyed: lanes may outlive exit
  return *pool;
}

///////////////////////////////////////////////////////////////////////////////
// One OS thread running threadgroups.
///////////////////////////////////////////////////////////////////////////////

enum class State : unsigned char { ready, at_simd, at_barrier, done };

struct Lane {
  Context ctx;
  State state = State::ready;
  Collective* pending = nullptr;
};

struct Worker {
  Context scheduler;
  std::vector<Lane> lanes;
  std::vector<char*> stacks;
  std::vector<LaneIds> ids;
  int count = 0;     // lanes in the current threadgroup
  int current = -1;  // the lane running, -1 in the scheduler
  LaneFn fn = nullptr;
  void* const* buffers = nullptr;
  std::vector<std::pair<void*, size_t>> threadgroup_memory;
  std::string error;
  LaneOrder order = LaneOrder::forward;
  std::mt19937_64 rng;

  ~Worker() {
    stack_pool().give_back(stacks);
  }
};

thread_local Worker* tw = nullptr;

Worker& worker() {
  if (!tw) {
    std::fprintf(stderr, "metal emulator: a Metal builtin was called outside a launch\n");
    std::abort();
  }
  return *tw;
}

void lane_entry() {
  Worker& w = *tw;
  const int me = w.current;
  w.fn(w.buffers, w.ids[me]);
  w.lanes[me].state = State::done;
  switch_context(w.lanes[me].ctx, w.scheduler);
  std::abort();  // a finished lane is never resumed
}

void suspend(State s) {
  Worker& w = worker();
  Lane& lane = w.lanes[w.current];
  lane.state = s;
  switch_context(lane.ctx, w.scheduler);
}

std::string format(const char* fmt, long long a = 0, long long b = 0, long long c = 0) {
  char buf[512];
  std::snprintf(buf, sizeof buf, fmt, a, b, c);
  return buf;
}

const char* op_name(Op op) {
  switch (op) {
    case Op::simd_barrier: return "simdgroup_barrier";
    case Op::simd_sum: return "simd_sum";
    case Op::simd_max: return "simd_max";
    case Op::simd_min: return "simd_min";
    case Op::simd_shuffle: return "simd_shuffle";
    case Op::simd_sum_int: return "simd_sum";
    case Op::simd_max_int: return "simd_max";
    case Op::matrix_multiply_accumulate: return "simdgroup_multiply_accumulate";
  }
  return "?";
}

// NaN-propagating max / min: what a kernel may not rely on is not assumed.
float max_of(float a, float b) {
  return (std::isnan(a) || std::isnan(b)) ? NAN : std::max(a, b);
}
float min_of(float a, float b) {
  return (std::isnan(a) || std::isnan(b)) ? NAN : std::min(a, b);
}

// The result of one SIMD-group operation for lanes c[0..n). "" or an error.
std::string combine(Collective** c, int n, int group) {
  const Op op = c[0]->op;
  for (int k = 1; k < n; ++k) {
    if (c[k]->op != op || c[k]->site != c[0]->site) {
      return "SIMD group " + std::to_string(group) + ": lane 0 is at " + op_name(op) + " but lane " +
          std::to_string(k) + " at " + op_name(c[k]->op) +
          (c[k]->op == op ? " from another call site" : "") +
          " (divergent control flow: on hardware the group hangs or mixes values)";
    }
  }
  switch (op) {
    case Op::simd_barrier:
      break;
    case Op::simd_sum: {
      float s = 0.0f;
      for (int k = 0; k < n; ++k) s += c[k]->f;
      for (int k = 0; k < n; ++k) c[k]->f_out = s;
      break;
    }
    case Op::simd_max:
    case Op::simd_min: {
      float r = c[0]->f;
      for (int k = 1; k < n; ++k) r = op == Op::simd_max ? max_of(r, c[k]->f) : min_of(r, c[k]->f);
      for (int k = 0; k < n; ++k) c[k]->f_out = r;
      break;
    }
    case Op::simd_sum_int:
    case Op::simd_max_int: {
      long long r = op == Op::simd_sum_int ? 0 : c[0]->i;
      for (int k = 0; k < n; ++k) r = op == Op::simd_sum_int ? r + c[k]->i : std::max(r, c[k]->i);
      for (int k = 0; k < n; ++k) c[k]->i_out = r;
      break;
    }
    case Op::simd_shuffle:
      for (int k = 0; k < n; ++k) {
        const int src = c[k]->arg;
        if (src < 0 || src >= n) {
          return format("simd_shuffle: lane %lld reads lane %lld of a %lld-lane SIMD group", k, src, n);
        }
        c[k]->f_out = c[src]->f;
      }
      break;
    case Op::matrix_multiply_accumulate: {
      if (n != kSimdWidth) {
        return "simdgroup_multiply_accumulate needs all 32 lanes of a SIMD group; group " + std::to_string(group) +
            " has " + std::to_string(n);
      }
      float A[8][8], B[8][8], C[8][8];
      for (int k = 0; k < n; ++k) {
        const int r = frag_row(k), col = frag_col(k);
        for (int j = 0; j < 2; ++j) {
          A[r][col + j] = c[k]->a[j];
          B[r][col + j] = c[k]->b[j];
          C[r][col + j] = c[k]->c[j];
        }
      }
      for (int k = 0; k < n; ++k) {  // all gathered first: D may alias A, B or C
        const int r = frag_row(k), col = frag_col(k);
        for (int j = 0; j < 2; ++j) {
          float acc = C[r][col + j];
          for (int t = 0; t < 8; ++t) acc = std::fma(A[r][t], B[t][col + j], acc);
          c[k]->d[j] = acc;
        }
      }
      break;
    }
  }
  return "";
}

const char* state_name(State s) {
  switch (s) {
    case State::ready: return "running";
    case State::at_simd: return "a SIMD-group operation";
    case State::at_barrier: return "threadgroup_barrier";
    case State::done: return "return";
  }
  return "?";
}

// Runs one threadgroup to completion; false (with w.error) on failure.
bool run_threadgroup(Worker& w, const unsigned pos[3], const unsigned size[3], const unsigned grid[3],
                     const unsigned dispatch[3], const unsigned groups[3]) {
  const int n = static_cast<int>(size[0] * size[1] * size[2]);
  w.count = n;
  const int simd_groups = (n + kSimdWidth - 1) / kSimdWidth;
  for (int t = 0; t < n; ++t) {
    LaneIds& id = w.ids[t];
    const unsigned local[3] = {t % size[0], (t / size[0]) % size[1], t / (size[0] * size[1])};
    for (int d = 0; d < 3; ++d) {
      id.thread_position_in_threadgroup[d] = local[d];
      id.threadgroup_position_in_grid[d] = pos[d];
      id.thread_position_in_grid[d] = pos[d] * dispatch[d] + local[d];
      id.threads_per_threadgroup[d] = size[d];
      id.dispatch_threads_per_threadgroup[d] = dispatch[d];
      id.threadgroups_per_grid[d] = groups[d];
      id.threads_per_grid[d] = grid[d];
    }
    id.thread_index_in_threadgroup = t;
    id.simdgroup_index_in_threadgroup = t / kSimdWidth;
    id.thread_index_in_simdgroup = t % kSimdWidth;
    id.threads_per_simdgroup = kSimdWidth;
    id.simdgroups_per_threadgroup = simd_groups;
    start_context(w.lanes[t].ctx, w.stacks[t], kStackBytes, lane_entry);
    w.lanes[t].state = State::ready;
  }
  for (auto& [p, bytes] : w.threadgroup_memory) std::memset(p, 0xff, bytes);

  std::vector<int> order(n);
  std::vector<Collective*> gathered(kSimdWidth);
  for (;;) {
    order.clear();
    for (int t = 0; t < n; ++t) {
      if (w.lanes[t].state == State::ready) order.push_back(t);
    }
    if (w.order == LaneOrder::reverse) std::reverse(order.begin(), order.end());
    if (w.order == LaneOrder::shuffled) std::shuffle(order.begin(), order.end(), w.rng);
    for (int t : order) {
      w.current = t;
      switch_context(w.scheduler, w.lanes[t].ctx);
      w.current = -1;
      if (!w.error.empty()) return false;
    }

    bool progressed = false;
    for (int g = 0; g < simd_groups; ++g) {
      const int first = g * kSimdWidth, last = std::min(n, first + kSimdWidth);
      int waiting = 0, done = 0;
      for (int t = first; t < last; ++t) {
        waiting += w.lanes[t].state == State::at_simd;
        done += w.lanes[t].state == State::done;
      }
      if (waiting == 0 || waiting + done != last - first) continue;
      if (done) {
        for (int t = first; t < last; ++t) {
          if (w.lanes[t].state == State::at_simd) {
            w.error = "SIMD group " + std::to_string(g) + ": " + std::to_string(done) +
                " lanes returned while the others wait at " + op_name(w.lanes[t].pending->op);
            break;
          }
        }
        return false;
      }
      for (int t = first; t < last; ++t) gathered[t - first] = w.lanes[t].pending;
      w.error = combine(gathered.data(), last - first, g);
      if (!w.error.empty()) return false;
      for (int t = first; t < last; ++t) w.lanes[t].state = State::ready;
      progressed = true;
    }
    if (progressed) continue;

    int at_barrier = 0, done = 0;
    for (int t = 0; t < n; ++t) {
      at_barrier += w.lanes[t].state == State::at_barrier;
      done += w.lanes[t].state == State::done;
    }
    if (done == n) return true;
    if (at_barrier + done == n && done == 0) {
      for (int t = 0; t < n; ++t) w.lanes[t].state = State::ready;
      continue;
    }
    // Nothing can move: on hardware this threadgroup hangs.
    std::string where;
    for (int t = 0; t < n && where.size() < 300; ++t) {
      if (t == 0 || w.lanes[t].state != w.lanes[t - 1].state) {
        where += " lane " + std::to_string(t) + ": " + state_name(w.lanes[t].state) + ";";
      }
    }
    w.error = "deadlock: " + std::to_string(at_barrier) + " of " + std::to_string(n) +
        " threads wait at threadgroup_barrier, " + std::to_string(done) + " returned, the rest at SIMD-group operations:" +
        where;
    return false;
  }
}

}  // namespace

///////////////////////////////////////////////////////////////////////////////
// Calls from kernels (msl.h).
///////////////////////////////////////////////////////////////////////////////

void simd_collective(Collective& c) {
  worker().lanes[tw->current].pending = &c;
  suspend(State::at_simd);
}

void threadgroup_barrier() {
  suspend(State::at_barrier);
}

void register_threadgroup_memory(void* p, size_t bytes) {
  Worker& w = worker();
  for (auto& [q, n] : w.threadgroup_memory) {
    if (q == p) return;
  }
  w.threadgroup_memory.emplace_back(p, bytes);
  std::memset(p, 0xff, bytes);
  size_t total = 0;
  for (auto& [q, n] : w.threadgroup_memory) total += n;
  if (total > kMaxThreadgroupMemory) {
    fail(format("threadgroup memory of %lld bytes: Apple GPUs allow %lld", static_cast<long long>(total),
                static_cast<long long>(kMaxThreadgroupMemory))
             .c_str());
  }
}

int lane_in_simdgroup() {
  Worker& w = worker();
  return w.current % kSimdWidth;
}

void fail(const char* message) {
  Worker& w = worker();
  w.error = message;
  if (w.current < 0) {
    std::fprintf(stderr, "metal emulator: %s\n", message);
    std::abort();
  }
  suspend(State::done);  // the scheduler sees the error and abandons the threadgroup
  std::abort();
}

std::string launch(LaneFn fn, void* const* buffers, const unsigned grid[3], const unsigned threadgroup[3],
                   LaneOrder order, unsigned long long seed) {
  unsigned groups[3];
  unsigned long long total_groups = 1;
  for (int d = 0; d < 3; ++d) {
    if (threadgroup[d] == 0 || grid[d] == 0) return "grid and threadgroup sizes must be positive";
    groups[d] = (grid[d] + threadgroup[d] - 1) / threadgroup[d];
    total_groups *= groups[d];
  }
  const unsigned long long tg_threads = 1ull * threadgroup[0] * threadgroup[1] * threadgroup[2];
  if (tg_threads > kMaxThreadsPerThreadgroup) {
    return format("threadgroup of %lld threads: Apple GPUs allow %lld", static_cast<long long>(tg_threads),
                  kMaxThreadsPerThreadgroup);
  }
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const int workers = static_cast<int>(std::min<unsigned long long>({hw, 8ull, total_groups}));
  std::atomic<unsigned long long> next{0};
  std::mutex error_mu;
  std::string error;

  auto body = [&](int index) {
    Worker w;
    w.fn = fn;
    w.buffers = buffers;
    w.order = order;
    w.rng.seed(seed * 1000003ull + index);
    w.lanes.resize(tg_threads);
    w.ids.resize(tg_threads);
    for (unsigned long long t = 0; t < tg_threads; ++t) w.stacks.push_back(stack_pool().take());
    tw = &w;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!error.empty()) break;
      }
      const unsigned long long g = next.fetch_add(1);
      if (g >= total_groups) break;
      const unsigned pos[3] = {static_cast<unsigned>(g % groups[0]),
                               static_cast<unsigned>((g / groups[0]) % groups[1]),
                               static_cast<unsigned>(g / (1ull * groups[0] * groups[1]))};
      unsigned size[3];
      for (int d = 0; d < 3; ++d) size[d] = std::min(threadgroup[d], grid[d] - pos[d] * threadgroup[d]);
      if (!run_threadgroup(w, pos, size, grid, threadgroup, groups)) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (error.empty()) {
          error = "threadgroup (" + std::to_string(pos[0]) + ", " + std::to_string(pos[1]) + ", " +
              std::to_string(pos[2]) + "): " + w.error;
        }
        break;
      }
    }
    tw = nullptr;
  };
  if (workers == 1) {
    body(0);
  } else {
    std::vector<std::thread> threads;
    for (int i = 0; i < workers; ++i) threads.emplace_back(body, i);
    for (auto& t : threads) t.join();
  }
  return error;
}

}  // namespace fa_emu
