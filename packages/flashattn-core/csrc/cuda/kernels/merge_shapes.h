// The split merge's launch shape (generic.cu's fa_merge_<dtype>), in plain
// C++: the kernel sizes its shared memory from it and the planner
// (plan_generic.cpp) its launches, so the two cannot disagree.

#pragma once

namespace fa::merge_shapes {

constexpr int kThreads = 512;     // threads of a merge block (one block per query row)
constexpr int kMaxSplits = 1024;  // key splits a merge takes (its weights sit in shared memory)

}  // namespace fa::merge_shapes
