// The job's learning-rate schedule, shared by the workers (who apply it)
// and the coordinator (which reports it).
#ifndef GEOTRAIN_COMMON_LEARNING_RATE_H_
#define GEOTRAIN_COMMON_LEARNING_RATE_H_

#include "geotrain/v1/job.pb.h"

namespace geotrain {

// The learning-rate multiplier of `spec`'s schedule once `progress` (the
// fraction of the run's samples seen, in [0, 1]) has been reached.
double LearningRateScale(const v1::Optimizer& spec, double progress);

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_LEARNING_RATE_H_
