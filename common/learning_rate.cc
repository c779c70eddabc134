#include "common/learning_rate.h"

#include <algorithm>
#include <cmath>

namespace geotrain {

double LearningRateScale(const v1::Optimizer& spec, double progress) {
  progress = std::clamp(progress, 0.0, 1.0);
  const double warmup = spec.warmup_fraction();
  if (warmup > 0 && progress < warmup) return progress / warmup;
  if (spec.decay() != v1::Optimizer::DECAY_COSINE) return 1.0;
  const double t = warmup < 1 ? (progress - warmup) / (1 - warmup) : 1.0;
  const double floor = spec.min_lr_fraction();
  return floor + (1 - floor) * 0.5 * (1 + std::cos(M_PI * t));
}

}  // namespace geotrain
