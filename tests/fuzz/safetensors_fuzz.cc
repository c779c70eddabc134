// A safetensors header from a stranger (a model directory given to
// init_from): the parser must refuse or accept without reading outside the
// input, and what it accepts must hold its promises: every tensor inside
// the data section, sizes matching shape x dtype, no two overlapping.
// Accepted headers are encoded again and must parse back the same.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "tests/fuzz/fuzz_input.h"

#include "common/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (1 << 20)) return 0;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<geotrain::SafetensorsHeader> header =
      geotrain::ParseSafetensorsHeader(bytes, size, "fuzz");
  if (!header.ok()) return 0;
  const uint64_t data_size = size - header->data_start;
  uint64_t last_end = 0;
  std::vector<geotrain::SafetensorsBlob> blobs;
  for (const geotrain::SafetensorsTensor& t : header->tensors) {
    if (t.end > data_size || t.begin > t.end || t.begin < last_end) std::abort();
    uint64_t elements = 1;
    for (int64_t d : t.shape) elements *= static_cast<uint64_t>(d);
    if (elements * geotrain::SafetensorsDtypeSize(t.dtype) != t.end - t.begin) std::abort();
    last_end = t.end;
    blobs.push_back({t.name, t.dtype, t.shape, bytes.substr(header->data_start + t.begin,
                                                            t.end - t.begin)});
  }
  absl::StatusOr<std::string> again = geotrain::EncodeSafetensorsHeader(blobs, header->metadata);
  if (!again.ok()) std::abort();
  std::string file = *again;
  for (const geotrain::SafetensorsBlob& b : blobs) file += b.data;
  absl::StatusOr<geotrain::SafetensorsHeader> reparsed =
      geotrain::ParseSafetensorsHeader(file, file.size(), "fuzz (re-encoded)");
  if (!reparsed.ok() || reparsed->tensors.size() != header->tensors.size() ||
      reparsed->metadata != header->metadata) {
    std::abort();
  }
  return 0;
}
