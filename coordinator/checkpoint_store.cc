#include "coordinator/checkpoint_store.h"

#include <dirent.h>
#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/link_message.h"
#include "common/model_profile.h"
#include "coordinator/state_store.h"

namespace geotrain {

absl::Status CheckLayerCheckpoint(const v1::JobSpec& job, const v1::LayerCheckpoint& c) {
  const std::vector<LayerProfile> layers = ProfileLayers(job);
  if (c.layer() < 0 || c.layer() >= static_cast<int>(layers.size())) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint of layer ", c.layer(),
                                                   ": the model has ", layers.size()));
  }
  const std::string what = absl::StrCat("checkpoint of layer ", c.layer(), " at step ", c.step());
  if (c.step() < 0 || c.step() > job.steps() || c.optimizer_steps() < 0 || c.data_cursor() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": step, optimizer steps or data "
                                                   "cursor out of range (job of ", job.steps(),
                                                   " steps)"));
  }
  if (c.state_per_param() < 0 || c.state_per_param() > 2 ||
      c.optimizer_state_size() != c.state_per_param() * c.params_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", c.optimizer_state_size(), " optimizer tensors for ", c.params_size(),
        " parameters at ", c.state_per_param(), " per parameter"));
  }
  uint64_t elements = 0, bytes = 0;
  auto check = [&](const v1::TensorHeader& h, const char* kind) -> absl::Status {
    if (h.dtype() != v1::DTYPE_FLOAT32 || h.codec() != v1::CODEC_NONE || h.zstd()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": a ", kind, " is not plain float32"));
    }
    if (absl::Status header = CheckTensorHeader(h); !header.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", header.message()));
    }
    bytes += h.payload_bytes();
    return absl::OkStatus();
  };
  for (int i = 0; i < c.params_size(); ++i) {
    if (absl::Status ok = check(c.params(i), "parameter"); !ok.ok()) return ok;
    uint64_t n = 1;
    for (int64_t dim : c.params(i).shape()) n *= static_cast<uint64_t>(dim);
    elements += n;
  }
  for (int i = 0; i < c.optimizer_state_size(); ++i) {
    if (absl::Status ok = check(c.optimizer_state(i), "optimizer state"); !ok.ok()) return ok;
    // state_per_param tensors per parameter, in parameter order (m, v of p0, ...).
    const v1::TensorHeader& param = c.params(i / c.state_per_param());
    if (c.optimizer_state(i).shape().size() != param.shape().size() ||
        !std::equal(param.shape().begin(), param.shape().end(),
                    c.optimizer_state(i).shape().begin())) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": optimizer state ", i, " does not have its parameter's shape"));
    }
  }
  if (elements != layers[c.layer()].parameter_count) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", elements, " parameters; the layer has ",
                                                   layers[c.layer()].parameter_count));
  }
  if (bytes != c.payload().size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": tensors of ", bytes,
                                                   " bytes, payload of ", c.payload().size()));
  }
  size_t offset = 0;
  for (const auto* tensors : {&c.params(), &c.optimizer_state()}) {
    for (const v1::TensorHeader& h : *tensors) {
      if (absl::Status finite = CheckFinite(h, c.payload(), offset); !finite.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": ", finite.message()));
      }
      offset += h.payload_bytes();
    }
  }
  return absl::OkStatus();
}
namespace {

constexpr char kMagic[] = "GTCKPT01";
constexpr size_t kMagicBytes = 8;
constexpr size_t kHeaderBytes = kMagicBytes + 4 + 8;

absl::Status MakeDir(const std::string& path) {
  if (mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) {
    return absl::UnavailableError(absl::StrCat("mkdir ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

uint32_t Crc32(const std::string& bytes) {
  return static_cast<uint32_t>(
      crc32(0L, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size())));
}

template <typename T>
void AppendLittleEndian(std::string* out, T value) {
  for (size_t i = 0; i < sizeof(T); ++i) out->push_back(static_cast<char>(value >> (8 * i)));
}

template <typename T>
T ReadLittleEndian(const char* p) {
  T value = 0;
  for (size_t i = 0; i < sizeof(T); ++i) {
    value |= static_cast<T>(static_cast<unsigned char>(p[i])) << (8 * i);
  }
  return value;
}

absl::StatusOr<v1::LayerCheckpoint> ParseFile(const std::string& path, int layer, int step) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError("cannot open");
  std::stringstream buffer;
  buffer << in.rdbuf();
  absl::StatusOr<v1::LayerCheckpoint> checkpoint = ParseCheckpointFile(buffer.str());
  if (!checkpoint.ok()) return checkpoint.status();
  if (checkpoint->layer() != layer || checkpoint->step() != step) {
    return absl::DataLossError(absl::StrCat("holds layer ", checkpoint->layer(), " step ",
                                            checkpoint->step(), ", not what its name says"));
  }
  return checkpoint;
}

}  // namespace

std::string FormatCheckpointFile(const v1::LayerCheckpoint& checkpoint) {
  const std::string body = checkpoint.SerializeAsString();
  std::string file(kMagic, kMagicBytes);
  AppendLittleEndian<uint32_t>(&file, Crc32(body));
  AppendLittleEndian<uint64_t>(&file, body.size());
  return file + body;
}

absl::StatusOr<v1::LayerCheckpoint> ParseCheckpointFile(const std::string& data) {
  if (data.size() < kHeaderBytes || data.compare(0, kMagicBytes, kMagic) != 0) {
    return absl::DataLossError("not a checkpoint file (bad magic or too short)");
  }
  const uint32_t crc = ReadLittleEndian<uint32_t>(data.data() + kMagicBytes);
  const uint64_t length = ReadLittleEndian<uint64_t>(data.data() + kMagicBytes + 4);
  if (length != data.size() - kHeaderBytes) {
    return absl::DataLossError(absl::StrCat("body is ", data.size() - kHeaderBytes,
                                            " bytes, header says ", length));
  }
  const std::string body = data.substr(kHeaderBytes);
  if (Crc32(body) != crc) return absl::DataLossError("checksum mismatch");
  v1::LayerCheckpoint checkpoint;
  if (!checkpoint.ParseFromString(body)) return absl::DataLossError("body does not parse");
  return checkpoint;
}


absl::StatusOr<std::unique_ptr<CheckpointStore>> CheckpointStore::Open(
    const std::string& state_dir, int keep) {
  const std::string dir = absl::StrCat(state_dir, "/checkpoints");
  if (absl::Status made = MakeDir(dir); !made.ok()) return made;
  auto store = std::unique_ptr<CheckpointStore>(new CheckpointStore(dir, std::max(1, keep)));
  absl::MutexLock lock(&store->mu_);
  store->ScanLocked();
  return store;
}

void CheckpointStore::ScanLocked() {
  DIR* dir = opendir(dir_.c_str());
  if (dir == nullptr) return;
  while (dirent* entry = readdir(dir)) {
    absl::string_view name = entry->d_name;
    int layer = 0;
    if (absl::ConsumePrefix(&name, "layer-") && absl::SimpleAtoi(name, &layer)) {
      index_[layer] = StepsOnDisk(layer);
    }
  }
  closedir(dir);
}

std::string CheckpointStore::PathOf(int layer, int step) const {
  return absl::StrFormat("%s/step-%08d.ckpt", LayerDir(layer), step);
}

std::string CheckpointStore::LayerDir(int layer) const {
  return absl::StrFormat("%s/layer-%04d", dir_, layer);
}

std::vector<int> CheckpointStore::StepsOnDisk(int layer) const {
  std::vector<int> steps;
  DIR* dir = opendir(LayerDir(layer).c_str());
  if (dir == nullptr) return steps;
  while (dirent* entry = readdir(dir)) {
    absl::string_view name = entry->d_name;
    int step = 0;
    if (absl::ConsumePrefix(&name, "step-") && absl::ConsumeSuffix(&name, ".ckpt") &&
        absl::SimpleAtoi(name, &step)) {
      steps.push_back(step);
    }
  }
  closedir(dir);
  std::sort(steps.begin(), steps.end());
  return steps;
}

absl::Status CheckpointStore::Save(const v1::LayerCheckpoint& checkpoint) {
  if (checkpoint.layer() < 0 || checkpoint.step() < 0) {
    return absl::InvalidArgumentError("checkpoint with a negative layer or step");
  }
  const std::string file = FormatCheckpointFile(checkpoint);
  absl::MutexLock lock(&mu_);
  if (absl::Status made = MakeDir(LayerDir(checkpoint.layer())); !made.ok()) return made;
  const std::string path = PathOf(checkpoint.layer(), checkpoint.step());
  if (absl::Status written = WriteFileAtomically(path, file); !written.ok()) return written;
  std::vector<int>& steps = index_[checkpoint.layer()];
  if (!std::binary_search(steps.begin(), steps.end(), checkpoint.step())) {
    steps.insert(std::upper_bound(steps.begin(), steps.end(), checkpoint.step()),
                 checkpoint.step());
  }
  while (steps.size() > static_cast<size_t>(keep_)) {
    std::remove(PathOf(checkpoint.layer(), steps.front()).c_str());
    steps.erase(steps.begin());
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::LayerCheckpoint> CheckpointStore::LoadLatest(
    int layer, std::vector<std::string>* skipped) {
  absl::MutexLock lock(&mu_);
  auto found = index_.find(layer);
  const std::vector<int> steps = found == index_.end() ? std::vector<int>() : found->second;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    const std::string path = PathOf(layer, *it);
    absl::StatusOr<v1::LayerCheckpoint> checkpoint = ParseFile(path, layer, *it);
    if (checkpoint.ok()) return checkpoint;
    if (skipped != nullptr) skipped->push_back(absl::StrCat(path, ": ", checkpoint.status().message()));
  }
  return absl::NotFoundError(absl::StrCat("no intact checkpoint of layer ", layer));
}

absl::StatusOr<v1::LayerCheckpoint> CheckpointStore::Load(int layer, int step) {
  absl::MutexLock lock(&mu_);
  auto found = index_.find(layer);
  if (found == index_.end() ||
      std::find(found->second.begin(), found->second.end(), step) == found->second.end()) {
    return absl::NotFoundError(absl::StrCat("no checkpoint of layer ", layer, " at step ", step));
  }
  return ParseFile(PathOf(layer, step), layer, step);
}

std::map<int, std::vector<int>> CheckpointStore::Index() const {
  absl::MutexLock lock(&mu_);
  return index_;
}

}  // namespace geotrain
