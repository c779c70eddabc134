// One logical message on a Link stream (header + tensor payload bytes), its
// split into ~1 MiB frames and its reassembly. Torch-free: tensors here are
// bytes described by TensorHeaders.
#ifndef GEOTRAIN_COMMON_LINK_MESSAGE_H_
#define GEOTRAIN_COMMON_LINK_MESSAGE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/link_frame_wire.h"
#include "common/model_profile.h"
#include "geotrain/v1/stage.pb.h"

namespace geotrain {

// Frames carry at most this much tensor payload each.
inline constexpr size_t kFrameBytes = 1 << 20;
// A message larger than this is refused before any of it is buffered.
inline constexpr uint64_t kMaxMessageBytes = 1ull << 30;

struct LinkMessage {
  v1::LinkHeader header;
  std::string payload;  // tensors' payloads, concatenated in header order
};

// The version of the weights the stage that sent `header` computed it
// with: its entry of weight_versions, else weight_version.
inline int64_t SenderWeightVersion(const v1::LinkHeader& header) {
  const int stage = header.from_stage();
  if (stage >= 0 && stage < header.weight_versions_size()) return header.weight_versions(stage);
  return header.weight_version();
}

// Bytes of one element of `dtype`, 0 for unknown dtypes.
size_t DTypeSize(v1::DType dtype);

// One frame of a message as a range of its payload.
struct FrameRange {
  size_t offset = 0;
  size_t size = 0;
  bool last = false;  // the first frame carries the header
};

// How `message_bytes` of payload split into frames of at most `frame_bytes`
// each. A message without payload is one frame.
std::vector<FrameRange> FrameRanges(size_t message_bytes, size_t frame_bytes = kFrameBytes);

// The same frames as protos, their data copied (tests and tools; the links
// send FrameRanges straight from the payload).
std::vector<v1::LinkFrame> SplitIntoFrames(const LinkMessage& message,
                                           size_t frame_bytes = kFrameBytes);

// Reassembles messages from frames, one message at a time. Not thread-safe.
// `check_header`, when given, judges each message's header at its first
// frame (against the plan): nothing of a message is buffered before its
// header passes, and then at most the payload bytes it announced.
class FrameAssembler {
 public:
  using HeaderCheck = std::function<absl::Status(const v1::LinkHeader&)>;
  explicit FrameAssembler(uint64_t max_message_bytes = kMaxMessageBytes,
                          HeaderCheck check_header = nullptr)
      : max_message_bytes_(max_message_bytes), check_header_(std::move(check_header)) {}

  // Adds one frame. Returns the completed message when `frame` was its last,
  // nullopt while more frames are due, and INVALID_ARGUMENT when the frames
  // disagree with the header (sizes, order, limit).
  // The frame's data is appended to the message's payload: the one copy
  // between the transport's buffers and the message.
  absl::StatusOr<std::optional<LinkMessage>> Add(FrameParts frame);
  // The same for a parsed proto (tests, fuzzing).
  absl::StatusOr<std::optional<LinkMessage>> Add(v1::LinkFrame frame);

 private:
  uint64_t max_message_bytes_;
  HeaderCheck check_header_;
  bool in_message_ = false;
  uint64_t expected_bytes_ = 0;
  LinkMessage current_;
};

// Size of the encoding of `elements` float32 values by `codec`: exact for
// every codec but topk, whose size is at most the returned bound
// (`*exact` tells which). INVALID_ARGUMENT for unknown codecs or block sizes.
absl::StatusOr<uint64_t> EncodedSizeBound(v1::Codec codec, uint64_t elements,
                                          uint32_t block_size, bool* exact);

// Checks one tensor header: known dtype and codec (codecs other than none
// only for float32), non-negative dims, and payload and encoded sizes that
// match shape, dtype, codec and block size.
absl::Status CheckTensorHeader(const v1::TensorHeader& header);

// Checks that `header` matches `spec`, except that dimension 0 (the batch)
// may be anything in [1, spec.shape[0]].
absl::Status CheckTensorMatches(const v1::TensorHeader& header,
                                const TensorSpec& spec, const char* what);

// Checks that every float32 element of the tensor at `offset` is finite.
absl::Status CheckFinite(const v1::TensorHeader& header,
                         const std::string& payload, size_t offset);

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_LINK_MESSAGE_H_
