// dflash.cpp — LrSchedule (see optimizer.hpp).
#include "train/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace dflash {

double LrSchedule::at(int64_t step) const {
  if (step < warmup_steps) {
    return base_lr * static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup_steps));
  }
  const double span = static_cast<double>(std::max<int64_t>(1, total_steps - warmup_steps));
  const double progress = std::min(1.0, static_cast<double>(step - warmup_steps) / span);
  const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return base_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine);
}

}  // namespace dflash
