// The last few values made from keys, per thread: a model's layers repeat
// one call (every layer of a decode step has the same shapes), so the
// planner (cuda/dispatch.cpp) looks its launches up here before it makes them
// again (strings and vectors: about as much host time as the graph node
// itself).

#pragma once

#include <array>
#include <cstddef>
#include <memory>
#include <optional>
#include <utility>

namespace flashattn::cuda {

template <typename Key, typename Value, size_t N>
class Recent {
 public:
  // The value made for `key`, or nullptr.
  std::shared_ptr<const Value> find(const Key& key) const {
    for (const auto& slot : slots_) {
      if (slot && slot->first == key) return slot->second;
    }
    return nullptr;
  }

  // Keeps `value` for `key` in place of the oldest one.
  std::shared_ptr<const Value> put(Key key, Value value) {
    auto made = std::make_shared<const Value>(std::move(value));
    slots_[next_] = std::make_pair(std::move(key), made);
    next_ = (next_ + 1) % N;
    return made;
  }

 private:
  std::array<std::optional<std::pair<Key, std::shared_ptr<const Value>>>, N> slots_;
  size_t next_ = 0;
};

}  // namespace flashattn::cuda
