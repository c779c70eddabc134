// A LinkFrame's protobuf encoding handled in pieces, so that a frame's
// tensor bytes are never copied to serialize or parse it: the sender writes
// a small prefix (the header and the data field's tag and length), the data
// straight from the message's payload, and a suffix (the `last` flag); the
// receiver finds the data's bytes in whatever buffers the transport read
// them into. The bytes on the wire are exactly
// LinkFrame::SerializeToString's, so either side may be a plain protobuf
// peer.
#ifndef GEOTRAIN_COMMON_LINK_FRAME_WIRE_H_
#define GEOTRAIN_COMMON_LINK_FRAME_WIRE_H_

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "geotrain/v1/stage.pb.h"

namespace geotrain {

// The encoding of a LinkFrame up to its data: the header (when given) and,
// for `data_bytes` > 0, the data field's tag and length.
std::string FramePrefix(const v1::LinkHeader* header, size_t data_bytes);
// What follows the data: the `last` field when it is true, else nothing.
absl::string_view FrameSuffix(bool last);

// A parsed frame whose data stays where it was read: `data` are views into
// the buffers handed to ParseFrame, in order.
struct FrameParts {
  std::optional<v1::LinkHeader> header;
  std::vector<absl::string_view> data;
  size_t data_bytes = 0;
  bool last = false;
};

// Parses a LinkFrame's encoding split across `pieces` (e.g. a gRPC
// message's slices) as protobuf would: fields in any order, a repeated
// header merged, the last data and flag kept, unknown fields skipped.
// INVALID_ARGUMENT for anything protobuf would not parse.
absl::StatusOr<FrameParts> ParseFrame(absl::Span<const absl::string_view> pieces);

// Bytes of tensor payload copied in user space by this process, by where
// the copy happens; the per-message figures of the hot path's contract (at
// most 2 copies each way: docs/hot_path.md) are these over the payload
// bytes. Counted with relaxed atomics.
struct PayloadCopyCounters {
  std::atomic<uint64_t> tensor_to_payload{0};  // encoding a tensor (a codec's output counts)
  std::atomic<uint64_t> payload_to_wire{0};    // serializing frames (0 on every transport)
  std::atomic<uint64_t> wire_to_payload{0};    // reassembling a message from frames
  std::atomic<uint64_t> payload_to_tensor{0};  // decoding a tensor
  std::atomic<uint64_t> staging{0};            // intermediate buffers (zstd, codec scratch)

  void Reset();
};
PayloadCopyCounters& PayloadCopies();

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_LINK_FRAME_WIRE_H_
