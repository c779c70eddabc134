// Loading and checking job specs (geotrain.v1.JobSpec as .textproto).
#ifndef GEOTRAIN_COMMON_JOB_SPEC_H_
#define GEOTRAIN_COMMON_JOB_SPEC_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "geotrain/v1/job.pb.h"

namespace geotrain {

// Parses `text` (textproto) into a JobSpec, fills defaults and validates it.
// `source` names the text in error messages (usually the file path).
absl::StatusOr<v1::JobSpec> ParseJobSpec(const std::string& text,
                                         const std::string& source);

// Reads and parses the file at `path`. Errors name the file and the problem.
absl::StatusOr<v1::JobSpec> LoadJobSpec(const std::string& path);

// Fills unset fields with defaults (lease 5 s, AdamW lr 1e-3, ...).
void ApplyJobDefaults(v1::JobSpec* job);

// Checks that the job is complete and consistent. Call after defaults.
absl::Status ValidateJobSpec(const v1::JobSpec& job);

// The most pipelines the job allows (0: as many as the planner finds worth
// it): 1 without an outer block, else outer.max_pipelines, and with
// outer.split_batch at most the job's microbatches.
int PipelineCap(const v1::JobSpec& job);

// "sync", ... for Schedule values; ParseSchedule is its inverse.
std::string ScheduleName(v1::Schedule schedule);
absl::StatusOr<v1::Schedule> ParseSchedule(const std::string& name);

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_JOB_SPEC_H_
