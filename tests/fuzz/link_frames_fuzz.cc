// The frame assembler and the link-message validator, as a stage receives
// them: pieces of the input are LinkFrames (serialized protos) fed in order
// to a FrameAssembler whose header check is the validator's; every
// completed message is validated from both directions.
#include <cstddef>
#include <cstdint>

#include "common/job_spec.h"
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
    geotrain::v1::LinkFrame frame;
    if (!frame.ParseFromString(piece)) continue;
    if (frame.has_header()) {
      (void)validator->CheckHello(frame.header());
      for (const geotrain::v1::TensorHeader& t : frame.header().tensors()) {
        (void)geotrain::CheckTensorHeader(t);
      }
    }
    auto down = from_downstream.Add(frame);
    if (down.ok() && down->has_value()) (void)validator->CheckFromDownstream(**down);
    auto up = assembler.Add(std::move(frame));
    if (up.ok() && up->has_value()) (void)validator->CheckFromUpstream(**up);
  }
  return 0;
}
