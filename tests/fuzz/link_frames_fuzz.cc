// The frame parser, the frame assembler and the link-message validator, as
// a stage receives them: pieces of the input are encoded LinkFrames, each
// parsed by ParseFrame (split in three buffers, as gRPC's slices would
// split it) and fed in order to a FrameAssembler whose header check is the
// validator's; every completed message is validated from both directions.
// Where protobuf also parses a piece, both must read the same frame. A
// completed message is validated as it came and, re-committed, as an honest
// sender would have sent it: no fuzzer finds a SHA-256 match, and the checks
// after the commitment need inputs that pass it.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/commitment.h"
#include "common/job_spec.h"
#include "common/link_frame_wire.h"
#include "common/link_message.h"
#include "tests/fuzz/fuzz_input.h"
#include "worker/link_validator.h"

namespace {

const geotrain::v1::JobSpec& Job() {
  static const geotrain::v1::JobSpec* job = new geotrain::v1::JobSpec(*geotrain::ParseJobSpec(
      "gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 3 zstd: true", "fuzz"));
  return *job;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const geotrain::LinkValidator* validator =
      new geotrain::LinkValidator(Job(), 1, 1, 1, 3, {"w0"});
  geotrain::FrameAssembler assembler(8 << 20, [](const geotrain::v1::LinkHeader& header) {
    return validator->CheckHeaderFromUpstream(header);
  });
  geotrain::FrameAssembler from_downstream(8 << 20, [](const geotrain::v1::LinkHeader& header) {
    return validator->CheckHeaderFromDownstream(header);
  });
  for (const std::string& piece : geotrain::SplitFuzzInput(data, size)) {
    const absl::string_view whole(piece);
    const size_t a = whole.size() / 3, b = whole.size() - whole.size() / 5;
    const absl::string_view buffers[3] = {whole.substr(0, a), whole.substr(a, b - a),
                                          whole.substr(b)};
    absl::StatusOr<geotrain::FrameParts> parts = geotrain::ParseFrame(buffers);
    geotrain::v1::LinkFrame proto;
    if (parts.ok() && proto.ParseFromString(piece)) {
      std::string data;
      for (absl::string_view v : parts->data) data.append(v.data(), v.size());
      if (data != proto.data() || parts->last != proto.last() ||
          parts->header.has_value() != proto.has_header() ||
          (proto.has_header() &&
           parts->header->SerializeAsString() != proto.header().SerializeAsString())) {
        std::abort();  // ParseFrame and protobuf read different frames
      }
    }
    if (!parts.ok()) continue;
    if (parts->header.has_value()) {
      (void)validator->CheckHello(*parts->header);
      for (const geotrain::v1::TensorHeader& t : parts->header->tensors()) {
        (void)geotrain::CheckTensorHeader(t);
      }
    }
    auto recommitted = [](geotrain::LinkMessage message) {
      message.header.set_commitment(geotrain::CommitmentOf(message.header, message.payload));
      return message;
    };
    auto down = from_downstream.Add(*parts);
    if (down.ok() && down->has_value()) {
      (void)validator->CheckFromDownstream(**down);
      (void)validator->CheckFromDownstream(recommitted(**down));
    }
    auto up = assembler.Add(*std::move(parts));
    if (up.ok() && up->has_value()) {
      (void)validator->CheckFromUpstream(**up);
      (void)validator->CheckFromUpstream(recommitted(**up));
    }
  }
  return 0;
}
