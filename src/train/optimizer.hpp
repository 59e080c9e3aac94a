// dflash.cpp — the learning-rate schedule of a training run. The optimizer itself (AdamW, the
// gradient norm and its clip factor) is an op: src/ops/adamw.hpp, included here for the train
// backends that use both.
//
// Invariant: the schedule is a pure function of the 0-based step (a resumed run gets the same
// learning rates).
#pragma once

#include <cstdint>

#include "ops/adamw.hpp"

namespace dflash {

/// Learning-rate schedule: linear warmup then cosine decay to `min_lr_ratio`·`base_lr`
/// (HF `get_cosine_schedule_with_warmup` with a floor):
///   step < warmup:  base·step/warmup
///   else:           base·(min + (1−min)·½(1 + cos(π·(step−warmup)/(total−warmup))))
/// `step` is 0-based (the step about to be taken).
struct LrSchedule {
  double base_lr = 6e-4;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double min_lr_ratio = 0.0;
  /// The learning rate of 0-based step `step`.
  double at(int64_t step) const;
};

}  // namespace dflash
