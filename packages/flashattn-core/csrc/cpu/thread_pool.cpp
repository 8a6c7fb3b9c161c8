#include "thread_pool.h"

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#elif defined(__APPLE__)
#include <pthread.h>
#endif

namespace flashattn::cpu {

namespace {

int detect_cpus() {
  if (const char* env = std::getenv("FLASHATTN_NUM_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) {
      return std::min(n, 256);
    }
  }
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    return std::max(1, CPU_COUNT(&set));
  }
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

class Pool {
 public:
  explicit Pool(int size) : size_(size) {}

  // Never joined: the pool lives as long as the process.
  void start() {
    for (int w = 1; w < size_; ++w) {
      std::thread([this, w] { worker_loop(w); }).detach();
    }
  }

  int size() const {
    return size_;
  }

  bool try_run(int workers, const std::function<void(int)>& body) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) {
      return false;
    }
    workers = std::clamp(workers, 1, size_);
    {
      std::lock_guard<std::mutex> lock(m_);
      body_ = &body;
      workers_ = workers;
      pending_ = workers - 1;
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    std::exception_ptr mine;
    try {
      body(0);
    } catch (...) {
      mine = std::current_exception();
    }
    std::unique_lock<std::mutex> lock(m_);
    done_.wait(lock, [this] { return pending_ == 0; });
    body_ = nullptr;
    auto error = mine ? mine : error_;
    lock.unlock();
    if (error) {
      std::rethrow_exception(error);
    }
    return true;
  }

 private:
  void worker_loop(int w) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* body;
      {
        std::unique_lock<std::mutex> lock(m_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (w >= workers_) {
          continue;
        }
        body = body_;
      }
      std::exception_ptr error;
      try {
        (*body)(w);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(m_);
      if (error && !error_) {
        error_ = error;
      }
      if (--pending_ == 0) {
        done_.notify_one();
      }
    }
  }

  int size_;
  std::mutex busy_; // held by the caller of try_run
  std::mutex m_;
  std::condition_variable wake_, done_;
  const std::function<void(int)>* body_ = nullptr;
  int workers_ = 0;
  int pending_ = 0;
  uint64_t generation_ = 0;
  std::exception_ptr error_;
};

std::mutex g_pool_mutex;
Pool* g_pool = nullptr; // leaked on purpose: detached workers use it

#if defined(__linux__) || defined(__APPLE__)
// The child of a fork has none of the workers: start a new pool on demand.
void forget_pool_in_child() {
  new (&g_pool_mutex) std::mutex();
  g_pool = nullptr;
}
#endif

Pool& pool() {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  if (!g_pool) {
#if defined(__linux__) || defined(__APPLE__)
    static bool registered = [] {
      pthread_atfork(nullptr, nullptr, forget_pool_in_child);
      return true;
    }();
    (void)registered;
#endif
    g_pool = new Pool(detect_cpus());
    g_pool->start();
  }
  return *g_pool;
}

} // namespace

int pool_size() {
  return pool().size();
}

void parallel_run(int workers, const std::function<void(int)>& body) {
  if (workers <= 1 || !pool().try_run(workers, body)) {
    body(0);
  }
}

namespace {
thread_local std::unique_ptr<char[]> t_scratch;
thread_local size_t t_scratch_bytes = 0;
} // namespace

void* thread_scratch(size_t bytes) {
  if (t_scratch_bytes < bytes) {
    t_scratch.reset(new char[bytes]);
    t_scratch_bytes = bytes;
  }
  return t_scratch.get();
}

} // namespace flashattn::cpu
