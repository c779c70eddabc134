#include "worker/output_check.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/codec.h"
#include "common/status_macros.h"
#include "common/tensor_wire.h"

namespace geotrain {
namespace {

constexpr int kDeviceBlock = 64;  // the device term's block, for every codec

// Each element's block's largest magnitude, blocks of `block` elements of
// the flattened tensor (the int8/int4 codecs' layout).
torch::Tensor BlockAbsMax(const torch::Tensor& flat, int block) {
  const int64_t n = flat.numel();
  const int64_t blocks = (n + block - 1) / block;
  torch::Tensor padded = torch::zeros({blocks * block}, flat.options());
  padded.narrow(0, 0, n).copy_(flat.abs());
  return std::get<0>(padded.view({blocks, block}).max(1))
      .repeat_interleave(block)
      .narrow(0, 0, n);
}

// The codec's share of each element's bound, or nullopt when the codec
// cannot be recomputed.
std::optional<torch::Tensor> CodecBound(const v1::TensorHeader& header,
                                        const torch::Tensor& reference) {
  const int block = header.block_size() > 0 ? static_cast<int>(header.block_size()) : 64;
  switch (header.codec()) {
    case v1::CODEC_NONE:
      return torch::zeros_like(reference);
    case v1::CODEC_FP16: {
      torch::Tensor magnitude = reference.abs();
      return magnitude * std::ldexp(1.0, -11) + (magnitude - 65504.0).clamp_min(0);
    }
    case v1::CODEC_BF16:
      return reference.abs() * std::ldexp(1.0, -8);
    case v1::CODEC_INT8:
      return BlockAbsMax(reference, block) / 254.0;
    case v1::CODEC_INT4:
      return BlockAbsMax(reference, block) / 14.0;
    default:
      return std::nullopt;
  }
}

absl::StatusOr<size_t> OffsetOf(const LinkMessage& message, int index) {
  uint64_t offset = 0;
  for (int j = 0; j < index; ++j) offset += message.header.tensors(j).payload_bytes();
  if (offset > message.payload.size()) {
    return absl::InvalidArgumentError("tensor payloads exceed the message");
  }
  return static_cast<size_t>(offset);
}

absl::StatusOr<torch::Tensor> Decoded(const LinkMessage& message, int index) {
  ASSIGN_OR_RETURN(const size_t offset, OffsetOf(message, index));
  try {
    ASSIGN_OR_RETURN(torch::Tensor t,
                     DecodeTensor(message.header.tensors(index), message.payload, offset));
    return t.reshape({-1});
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(absl::StrCat("decoding tensor ", index, ": ", e.what()));
  }
}

OutputComparison Mismatch(std::string what) {
  OutputComparison result;
  result.mismatch = std::move(what);
  result.worst_ratio = INFINITY;
  result.relative_distance = INFINITY;
  return result;
}

// Adds one float tensor's comparison to `result`: `c` claimed, `r`
// recomputed, `bound` per element (all float64, flat, same size).
// Returns which elements are outside the bound.
torch::Tensor Accumulate(const torch::Tensor& c, const torch::Tensor& r,
                         const torch::Tensor& bound, OutputComparison* result,
                         double* difference_squared, double* reference_squared) {
  const torch::Tensor error = (c - r).abs();
  const torch::Tensor outside = error.gt(bound);
  result->elements += r.numel();
  result->violations += outside.sum().item<int64_t>();
  result->worst_ratio = std::max(result->worst_ratio, (error / bound).max().item<double>());
  *difference_squared += error.pow(2).sum().item<double>();
  *reference_squared += r.pow(2).sum().item<double>();
  return outside;
}

void Finish(double difference_squared, double reference_squared, double max_violation_fraction,
            OutputComparison* result) {
  result->relative_distance =
      reference_squared > 0 ? std::sqrt(difference_squared / reference_squared)
                            : (difference_squared > 0 ? INFINITY : 0);
  result->passed =
      result->violations <= static_cast<int64_t>(max_violation_fraction * result->elements);
}

// A layer's parameters, flat float64, from the front of its payload; with
// `with_state`, its optimizer state after them instead (per parameter in
// order, state_per_param each: the payload's order).
absl::StatusOr<std::vector<torch::Tensor>> ParamsOf(const v1::LayerCheckpoint& layer,
                                                    bool with_state = false) {
  std::vector<torch::Tensor> params;
  size_t offset = 0;
  auto decode = [&](const v1::TensorHeader& header) -> absl::Status {
    ASSIGN_OR_RETURN(torch::Tensor t, DecodeTensor(header, layer.payload(), offset));
    offset += header.payload_bytes();
    params.push_back(t.reshape({-1}).to(torch::kFloat64));
    return absl::OkStatus();
  };
  for (const v1::TensorHeader& header : layer.params()) RETURN_IF_ERROR(decode(header));
  if (!with_state) return params;
  params.clear();
  for (const v1::TensorHeader& header : layer.optimizer_state()) RETURN_IF_ERROR(decode(header));
  return params;
}

}  // namespace

double DeviceTolerance(const std::string& audited_device, const std::string& verifier_device) {
  const bool gpu = audited_device.rfind("cuda", 0) == 0 || verifier_device.rfind("cuda", 0) == 0;
  return gpu ? 2e-2 : 1e-3;
}

std::string OutputComparison::Summary() const {
  if (!verifiable) return absl::StrCat("unverifiable: ", unverifiable_reason);
  if (!failure.empty()) return absl::StrCat("FAILED: ", failure);
  if (!mismatch.empty()) return absl::StrCat("FAILED: the ", mismatch, " differs");
  std::string rows_part;
  if (rows > 0 && violations > 0) {
    rows_part = absl::StrFormat(" (in %d of %d rows)", rows_outside, rows);
  }
  return absl::StrFormat("%s: %d of %d elements outside the bound%s, worst %.3g x bound, "
                         "relative distance %.3g%s",
                         passed ? "passed" : "FAILED", violations, elements, rows_part,
                         worst_ratio, relative_distance,
                         widened ? " (bound widened for rounding)" : "");
}

absl::StatusOr<OutputComparison> CompareOutputs(const LinkMessage& claimed,
                                                const LinkMessage& recomputed,
                                                const OutputTolerance& tolerance,
                                                const RoundingAllowance& allowance) {
  const int count = recomputed.header.tensors_size();
  for (int i = 0; i < count; ++i) {
    const v1::TensorHeader& h = recomputed.header.tensors(i);
    if (h.dtype() == v1::DTYPE_FLOAT32 && (h.codec() != v1::CODEC_NONE || h.zstd())) {
      return absl::InvalidArgumentError(
          absl::StrCat("the recomputed tensor ", i, " is encoded (", CodecName(h.codec()),
                       "); a verifier compares unencoded float32"));
    }
  }
  if (claimed.header.tensors_size() != count) return Mismatch(absl::StrCat("tensor count (", claimed.header.tensors_size(), " against ", count, ")"));
  OutputComparison result;
  double difference_squared = 0;
  double reference_squared = 0;
  try {
    torch::NoGradGuard no_grad;
    for (int i = 0; i < count; ++i) {
      const v1::TensorHeader& claim = claimed.header.tensors(i);
      const v1::TensorHeader& mine = recomputed.header.tensors(i);
      if (claim.dtype() != mine.dtype() ||
          !std::equal(claim.shape().begin(), claim.shape().end(), mine.shape().begin(),
                      mine.shape().end())) {
        return Mismatch("tensor shape or dtype");
      }
      ASSIGN_OR_RETURN(torch::Tensor c, Decoded(claimed, i));
      ASSIGN_OR_RETURN(torch::Tensor r, Decoded(recomputed, i));
      if (mine.dtype() != v1::DTYPE_FLOAT32) {
        result.elements += r.numel();
        result.violations += c.ne(r).sum().item<int64_t>();
        continue;
      }
      std::optional<torch::Tensor> codec = CodecBound(claim, r);
      if (!codec.has_value()) {
        result.verifiable = false;
        result.unverifiable_reason =
            absl::StrCat(CodecName(claim.codec()),
                         " keeps the sender's error-feedback residual; no recomputation "
                         "reproduces it");
        result.passed = false;
        return result;
      }
      c = c.to(torch::kFloat64);
      r = r.to(torch::kFloat64);
      // The device term's scale: each element's block's largest
      // magnitude, and never less than the whole tensor's RMS. A block
      // can be small through cancellation (a confidently classified
      // sample's loss gradient is softmax minus one) and still carry the
      // rounding of what cancelled, at the tensor's scale; two LibTorch
      // builds (another exp, another BLAS) round it differently. Measured
      // across the wheel's MKL and Debian's OpenBLAS on test_pipelines'
      // MLP: up to 451,000 times a block-only bound, at a relative
      // distance of 1.4e-5.
      const torch::Tensor scale =
          torch::maximum(BlockAbsMax(r, kDeviceBlock), r.square().mean().sqrt());
      torch::Tensor bound = codec->to(torch::kFloat64) + tolerance.device * scale +
                            1e-30;  // an all-zero tensor allows exactly zero
      for (const LinkMessage& other : allowance.nearby) {
        if (other.header.tensors_size() != count ||
            other.header.tensors(i).dtype() != v1::DTYPE_FLOAT32) {
          return absl::InvalidArgumentError("a nearby recomputation has another form");
        }
        ASSIGN_OR_RETURN(torch::Tensor moved, Decoded(other, i));
        if (moved.numel() != r.numel()) {
          return absl::InvalidArgumentError("a nearby recomputation has another shape");
        }
        // Twice: the nearby point is not the audited build's own rounding,
        // so a flipped unit's change there is close to, not exactly, its
        // change in the claim (0.99 of the bound in the unit test).
        bound = bound + 2 * (moved.to(torch::kFloat64) - r).abs();
        result.widened = true;
      }
      if (i == 0 && allowance.floor.has_value()) {
        ASSIGN_OR_RETURN(torch::Tensor floor, Decoded(*allowance.floor, 0));
        if (floor.numel() != r.numel()) {
          return absl::InvalidArgumentError("the rounding floor has another shape");
        }
        bound = bound + floor.to(torch::kFloat64);
        result.widened = true;
      }
      const torch::Tensor outside =
          Accumulate(c, r, bound, &result, &difference_squared, &reference_squared);
      if (claim.shape_size() >= 2 && claim.shape(0) > 0 && r.numel() > 0) {
        // Where the elements outside fall, by the leading dimension (the
        // microbatch's samples): for telling one sample's difference from
        // a lie spread over all.
        result.rows += claim.shape(0);
        result.rows_outside += outside.reshape({claim.shape(0), -1}).any(1).sum().item<int64_t>();
      }
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("comparing outputs: ", e.what()));
  }
  Finish(difference_squared, reference_squared, tolerance.max_violation_fraction, &result);
  return result;
}

absl::StatusOr<OutputComparison> CompareUpdates(
    const std::vector<v1::LayerCheckpoint>& before,
    const std::vector<v1::LayerCheckpoint>& claimed_after,
    const std::vector<v1::LayerCheckpoint>& recomputed_after, const UpdateTolerance& tolerance) {
  if (before.size() != recomputed_after.size()) {
    return absl::InvalidArgumentError("the recomputation has other layers than the weights before");
  }
  if (claimed_after.size() != recomputed_after.size()) {
    return Mismatch(absl::StrCat("layer count (", claimed_after.size(), " against ",
                                 recomputed_after.size(), ")"));
  }
  OutputComparison result;
  double difference_squared = 0;
  double reference_squared = 0;
  try {
    torch::NoGradGuard no_grad;
    for (size_t l = 0; l < recomputed_after.size(); ++l) {
      if (claimed_after[l].layer() != recomputed_after[l].layer()) {
        return Mismatch(absl::StrCat("layer (", claimed_after[l].layer(), " against ",
                                     recomputed_after[l].layer(), ")"));
      }
      ASSIGN_OR_RETURN(std::vector<torch::Tensor> w0, ParamsOf(before[l]));
      ASSIGN_OR_RETURN(std::vector<torch::Tensor> claimed, ParamsOf(claimed_after[l]));
      ASSIGN_OR_RETURN(std::vector<torch::Tensor> mine, ParamsOf(recomputed_after[l]));
      if (w0.size() != mine.size()) {
        return absl::InvalidArgumentError("the weights before have other parameters");
      }
      if (claimed.size() != mine.size()) return Mismatch("parameter count");
      for (size_t p = 0; p < mine.size(); ++p) {
        if (claimed[p].numel() != mine[p].numel() || w0[p].numel() != mine[p].numel()) {
          return Mismatch("parameter shape");
        }
        const torch::Tensor update = mine[p] - w0[p];
        const torch::Tensor bound = tolerance.update_fraction * BlockAbsMax(update, kDeviceBlock) +
                                    tolerance.device * BlockAbsMax(mine[p], kDeviceBlock) + 1e-30;
        Accumulate(claimed[p] - w0[p], update, bound, &result, &difference_squared,
                   &reference_squared);
      }
      // The optimizer state after the update, by the same rule: its change
      // against the recomputed change (the state before the first update
      // is zero). Moments made up to cancel an update miss by far more.
      const v1::LayerCheckpoint& claimed_layer = claimed_after[l];
      const v1::LayerCheckpoint& my_layer = recomputed_after[l];
      if (my_layer.optimizer_state_size() == 0) continue;
      if (claimed_layer.optimizer_state_size() != my_layer.optimizer_state_size()) {
        return Mismatch(absl::StrCat("optimizer state tensor count (",
                                     claimed_layer.optimizer_state_size(), " against ",
                                     my_layer.optimizer_state_size(), ")"));
      }
      if (claimed_layer.optimizer_steps() != my_layer.optimizer_steps()) {
        return Mismatch(absl::StrCat("optimizer step count (", claimed_layer.optimizer_steps(),
                                     " against ", my_layer.optimizer_steps(), ")"));
      }
      ASSIGN_OR_RETURN(std::vector<torch::Tensor> s0, ParamsOf(before[l], true));
      ASSIGN_OR_RETURN(std::vector<torch::Tensor> claimed_state, ParamsOf(claimed_layer, true));
      ASSIGN_OR_RETURN(std::vector<torch::Tensor> my_state, ParamsOf(my_layer, true));
      if (!s0.empty() && s0.size() != my_state.size()) {
        return absl::InvalidArgumentError("the optimizer state before has another layout");
      }
      for (size_t k = 0; k < my_state.size(); ++k) {
        if (claimed_state[k].numel() != my_state[k].numel() ||
            (!s0.empty() && s0[k].numel() != my_state[k].numel())) {
          return Mismatch("optimizer state shape");
        }
        const torch::Tensor start = s0.empty() ? torch::zeros_like(my_state[k]) : s0[k];
        const torch::Tensor change = my_state[k] - start;
        const torch::Tensor bound =
            tolerance.update_fraction * BlockAbsMax(change, kDeviceBlock) +
            std::max(tolerance.device, tolerance.state) * BlockAbsMax(my_state[k], kDeviceBlock) +
            1e-30;
        Accumulate(claimed_state[k] - start, change, bound, &result, &difference_squared,
                   &reference_squared);
      }
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("comparing updates: ", e.what()));
  }
  Finish(difference_squared, reference_squared, tolerance.max_violation_fraction, &result);
  return result;
}

}  // namespace geotrain
