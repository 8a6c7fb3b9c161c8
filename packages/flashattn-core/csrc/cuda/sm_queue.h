// A launch's blocks in launch order onto whichever SM is free first: the
// planner's models of a launch's span (wg_launch.cpp, plan_prefill.cpp).

#pragma once

#include <algorithm>
#include <functional>
#include <queue>
#include <vector>

namespace flashattn::cuda {

class SmQueue {
 public:
  explicit SmQueue(int sms) {
    for (int i = 0; i < sms; ++i) free_at_.push(0.0);
  }
  // A block costing `cost` on the first free SM; when it ends.
  double run(double cost) {
    const double start = free_at_.top();
    free_at_.pop();
    free_at_.push(start + cost);
    end_ = std::max(end_, start + cost);
    return start + cost;
  }
  double end() const { return end_; }  // when the last block ends

 private:
  std::priority_queue<double, std::vector<double>, std::greater<double>> free_at_;
  double end_ = 0;
};

}  // namespace flashattn::cuda
