// RETURN_IF_ERROR / ASSIGN_OR_RETURN for absl::Status and absl::StatusOr.
#ifndef GEOTRAIN_COMMON_STATUS_MACROS_H_
#define GEOTRAIN_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define GT_CONCAT_INNER_(a, b) a##b
#define GT_CONCAT_(a, b) GT_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status) and returns it from the enclosing
// function when it is not OK.
#define RETURN_IF_ERROR(expr)                 \
  do {                                        \
    ::absl::Status gt_status_ = (expr);       \
    if (!gt_status_.ok()) return gt_status_;  \
  } while (0)

// `lhs` = value of `rexpr` (an absl::StatusOr<T>), or returns its status.
#define ASSIGN_OR_RETURN(lhs, rexpr) \
  GT_ASSIGN_OR_RETURN_IMPL_(GT_CONCAT_(gt_statusor_, __LINE__), lhs, rexpr)

#define GT_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                              \
  if (!statusor.ok()) return statusor.status();         \
  lhs = std::move(statusor).value()

#endif  // GEOTRAIN_COMMON_STATUS_MACROS_H_
