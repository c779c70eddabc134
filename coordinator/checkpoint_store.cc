#include "coordinator/checkpoint_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/files.h"
#include "common/layer_state.h"
#include "common/link_message.h"
#include "common/model_profile.h"
#include "common/status_macros.h"

namespace geotrain {

absl::Status CheckLayerCheckpointHeader(const v1::JobSpec& job, const v1::LayerCheckpoint& c,
                                        uint64_t payload_bytes) {
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
  // Each parameter's shape, in the layer's order: a checkpoint of the right
  // size cut into other shapes could not be loaded.
  const std::vector<ParameterSpec> expected = LayerParameters(job, c.layer());
  if (c.params_size() != static_cast<int>(expected.size())) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", c.params_size(),
                                                   " parameters; the layer has ",
                                                   expected.size()));
  }
  for (int i = 0; i < c.params_size(); ++i) {
    if (absl::Status ok = check(c.params(i), "parameter"); !ok.ok()) return ok;
    const std::vector<int64_t>& shape = expected[i].shape;
    if (!std::equal(c.params(i).shape().begin(), c.params(i).shape().end(), shape.begin(),
                    shape.end())) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": parameter ", i, " (", expected[i].name, ") has shape [",
          absl::StrJoin(c.params(i).shape(), ", "), "], not [", absl::StrJoin(shape, ", "),
          "]"));
    }
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
  // The outer optimizer's (job.outer): one tensor per parameter, of its
  // shape, or none.
  for (const auto* outer : {&c.outer_weights(), &c.outer_momentum()}) {
    if (!outer->empty() && outer->size() != c.params_size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": ", outer->size(), " outer tensors for ", c.params_size(), " parameters"));
    }
    for (int i = 0; i < outer->size(); ++i) {
      if (absl::Status ok = check((*outer)[i], "outer tensor"); !ok.ok()) return ok;
      const auto& shape = c.params(i).shape();
      if ((*outer)[i].shape().size() != shape.size() ||
          !std::equal(shape.begin(), shape.end(), (*outer)[i].shape().begin())) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": outer tensor ", i, " does not have its parameter's shape"));
      }
    }
  }
  if (c.outer_weights().empty() && !c.outer_momentum().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": an outer momentum without weights"));
  }
  if (c.outer_rounds() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": negative outer rounds"));
  }
  if (elements != layers[c.layer()].parameter_count) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", elements, " parameters; the layer has ",
                                                   layers[c.layer()].parameter_count));
  }
  if (bytes != payload_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": tensors of ", bytes,
                                                   " bytes, payload of ", payload_bytes));
  }
  return absl::OkStatus();
}

absl::Status CheckFiniteFloats(absl::string_view data, const std::string& what) {
  if (data.size() % 4 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", data.size(),
                                                   " bytes is not a whole number of float32s"));
  }
  for (size_t i = 0; i < data.size(); i += 4) {
    float value;
    std::memcpy(&value, data.data() + i, 4);
    if (!std::isfinite(value)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": a value that is not finite"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckLayerCheckpoint(const v1::JobSpec& job, const v1::LayerCheckpoint& c) {
  RETURN_IF_ERROR(CheckLayerCheckpointHeader(job, c, c.payload().size()));
  return CheckFiniteFloats(c.payload(), absl::StrCat("checkpoint of layer ", c.layer(),
                                                     " at step ", c.step()));
}

namespace {

constexpr char kLegacyMagic[] = "GTCKPT01";
constexpr char kMagic[] = "GTCKPT02";
constexpr size_t kMagicBytes = 8;
constexpr size_t kFileFrameBytes = kMagicBytes + 4 + 8;
// A header lists the layer's tensors: far below this even for a huge layer.
constexpr uint64_t kMaxHeaderBytes = 4 << 20;
constexpr size_t kIoBytes = 1 << 20;

absl::Status MakeDir(const std::string& path) {
  if (mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) {
    return absl::UnavailableError(absl::StrCat("mkdir ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status ErrnoError(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
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

// The 20-byte frame with a CRC of `crc`, then the header's length.
std::string Frame(uint32_t crc, uint64_t header_bytes) {
  std::string frame(kMagic, kMagicBytes);
  AppendLittleEndian<uint32_t>(&frame, crc);
  AppendLittleEndian<uint64_t>(&frame, header_bytes);
  return frame;
}

// Reads exactly `n` bytes at `offset`; DATA_LOSS if the file is shorter.
absl::Status ReadAt(int fd, uint64_t offset, size_t n, char* out) {
  size_t done = 0;
  while (done < n) {
    const ssize_t got = pread(fd, out + done, n - done, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return ErrnoError("read");
    if (got == 0) return absl::DataLossError("file ends early");
    done += static_cast<size_t>(got);
  }
  return absl::OkStatus();
}

}  // namespace

std::string FormatCheckpointFile(const v1::LayerCheckpoint& checkpoint) {
  const std::string header = LayerStateHeader(checkpoint).SerializeAsString();
  const uint32_t crc = Crc32Update(Crc32Update(0, header), checkpoint.payload());
  return Frame(crc, header.size()) + header + checkpoint.payload();
}

absl::StatusOr<v1::LayerCheckpoint> ParseCheckpointFile(const std::string& data) {
  if (data.size() < kFileFrameBytes) {
    return absl::DataLossError("not a checkpoint file (too short)");
  }
  const uint32_t crc = ReadLittleEndian<uint32_t>(data.data() + kMagicBytes);
  const uint64_t length = ReadLittleEndian<uint64_t>(data.data() + kMagicBytes + 4);
  const absl::string_view rest = absl::string_view(data).substr(kFileFrameBytes);
  v1::LayerCheckpoint checkpoint;
  if (data.compare(0, kMagicBytes, kLegacyMagic) == 0) {
    if (length != rest.size()) {
      return absl::DataLossError(absl::StrCat("body is ", rest.size(), " bytes, header says ",
                                              length));
    }
    if (Crc32Update(0, rest) != crc) return absl::DataLossError("checksum mismatch");
    if (!checkpoint.ParseFromArray(rest.data(), static_cast<int>(rest.size()))) {
      return absl::DataLossError("body does not parse");
    }
    return checkpoint;
  }
  if (data.compare(0, kMagicBytes, kMagic) != 0) {
    return absl::DataLossError("not a checkpoint file (bad magic)");
  }
  if (length > rest.size() || length > kMaxHeaderBytes) {
    return absl::DataLossError(absl::StrCat("header of ", length, " bytes in a file of ",
                                            data.size()));
  }
  if (Crc32Update(0, rest) != crc) return absl::DataLossError("checksum mismatch");
  if (!checkpoint.ParseFromArray(rest.data(), static_cast<int>(length)) ||
      !checkpoint.payload().empty()) {
    return absl::DataLossError("header does not parse");
  }
  checkpoint.set_payload(std::string(rest.substr(length)));
  return checkpoint;
}

CheckpointWriter::~CheckpointWriter() {
  if (fd_ >= 0) close(fd_);
  if (!committed_) unlink(tmp_.c_str());
}

absl::Status CheckpointWriter::Append(absl::string_view data) {
  if (committed_ || fd_ < 0) return absl::FailedPreconditionError("checkpoint already committed");
  if (data.size() > payload_bytes_ - written_) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint of layer ", layer_, " step ", step_,
                                                   ": more than the announced ", payload_bytes_,
                                                   " payload bytes"));
  }
  RETURN_IF_ERROR(WriteAll(fd_, std::string_view(data.data(), data.size()), tmp_));
  crc_ = Crc32Update(crc_, data);
  written_ += data.size();
  return absl::OkStatus();
}

absl::Status CheckpointWriter::Commit() {
  if (committed_ || fd_ < 0) return absl::FailedPreconditionError("checkpoint already committed");
  if (written_ != payload_bytes_) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint of layer ", layer_, " step ",
                                                      step_, ": ", written_, " of ",
                                                      payload_bytes_, " payload bytes"));
  }
  // The CRC goes into the frame written first (it covers what followed).
  char crc[4];
  for (int i = 0; i < 4; ++i) crc[i] = static_cast<char>(crc_ >> (8 * i));
  if (pwrite(fd_, crc, 4, kMagicBytes) != 4) return ErrnoError("write " + tmp_);
  if (fsync(fd_) != 0) return ErrnoError("fsync " + tmp_);
  close(fd_);
  fd_ = -1;
  RETURN_IF_ERROR(store_->CommitFile(tmp_, layer_, step_, uploader_, rollbacks_));
  committed_ = true;
  return absl::OkStatus();
}

CheckpointReader::~CheckpointReader() {
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<size_t> CheckpointReader::Read(size_t max_bytes, std::string* out) {
  const size_t n = static_cast<size_t>(std::min<uint64_t>(max_bytes, payload_bytes_ - offset_));
  if (n == 0) return 0;
  if (fd_ < 0) {
    out->append(legacy_payload_, offset_, n);
  } else {
    const size_t before = out->size();
    out->resize(before + n);
    if (absl::Status read = ReadAt(fd_, file_offset_ + offset_, n, out->data() + before);
        !read.ok()) {
      out->resize(before);
      return read;
    }
  }
  offset_ += n;
  return n;
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
      for (int step : index_[layer]) {
        absl::StatusOr<std::unique_ptr<CheckpointReader>> reader = OpenFile(layer, step);
        uploaders_[{layer, step}] = reader.ok() ? (*reader)->header().worker_id() : "";
      }
    }
  }
  closedir(dir);
}

std::optional<absl::Time> CheckpointStore::WrittenAt(int layer, int step) const {
  struct stat st;
  if (stat(PathOf(layer, step).c_str(), &st) != 0) return std::nullopt;
  return absl::TimeFromTimespec(st.st_mtim);
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

absl::StatusOr<std::unique_ptr<CheckpointWriter>> CheckpointStore::BeginSave(
    const v1::LayerCheckpoint& header, uint64_t payload_bytes) {
  if (header.layer() < 0 || header.step() < 0) {
    return absl::InvalidArgumentError("checkpoint with a negative layer or step");
  }
  if (!header.payload().empty()) {
    return absl::InvalidArgumentError("a checkpoint header with a payload of its own");
  }
  const std::string header_bytes = header.SerializeAsString();
  std::string tmp;
  uint64_t rollbacks = 0;
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(MakeDir(LayerDir(header.layer())));
    tmp = absl::StrCat(PathOf(header.layer(), header.step()), ".tmp", next_temp_++);
    rollbacks = rollbacks_;
  }
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return ErrnoError("open " + tmp);
  auto writer = std::unique_ptr<CheckpointWriter>(
      new CheckpointWriter(this, header.layer(), header.step(), header.worker_id(), tmp, fd,
                           payload_bytes, rollbacks));
  RETURN_IF_ERROR(WriteAll(fd, Frame(0, header_bytes.size()) + header_bytes, tmp));
  writer->crc_ = Crc32Update(0, header_bytes);
  return writer;
}

absl::Status CheckpointStore::CommitFile(const std::string& tmp, int layer, int step,
                                         const std::string& uploader, uint64_t rollbacks) {
  absl::MutexLock lock(&mu_);
  if (rollbacks != rollbacks_) {
    // Computed before a rollback, from weights it discarded.
    std::remove(tmp.c_str());
    return absl::AbortedError(absl::StrCat("checkpoint of layer ", layer, " step ", step,
                                           " begun before the job was rolled back"));
  }
  if (!uploader.empty() && quarantined_.count(uploader) > 0) {
    // Begun before the quarantine, committed after it: kept for an
    // operator with the uploader's other files, never indexed.
    RETURN_IF_ERROR(MakeDir(QuarantineDir()));
    const std::string to =
        absl::StrFormat("%s/layer-%04d-step-%08d.ckpt", QuarantineDir(), layer, step);
    if (rename(tmp.c_str(), to.c_str()) != 0) return ErrnoError("rename " + tmp);
    return absl::PermissionDeniedError(
        absl::StrCat("the checkpoints of ", uploader, " are quarantined"));
  }
  const std::string path = PathOf(layer, step);
  if (rename(tmp.c_str(), path.c_str()) != 0) return ErrnoError("rename " + tmp + " -> " + path);
  const int dir_fd = open(LayerDir(layer).c_str(), O_RDONLY | O_DIRECTORY);
  if (dir_fd >= 0) {
    fsync(dir_fd);
    close(dir_fd);
  }
  std::vector<int>& steps = index_[layer];
  if (!std::binary_search(steps.begin(), steps.end(), step)) {
    steps.insert(std::upper_bound(steps.begin(), steps.end(), step), step);
  }
  uploaders_[{layer, step}] = uploader;
  PruneLocked(layer);
  return absl::OkStatus();
}

void CheckpointStore::PruneLocked(int layer) {
  constexpr size_t kOtherUploaders = 2;
  // Above the pin, the newest checkpoint of each bucket of `width` steps
  // (about 8 buckets up to the newest), so that when the pin moves up (an
  // audit passed) a checkpoint near it is still there: audits come seconds
  // after their step, when a fast job's newest few are many steps ahead.
  // The width is a power of two, so a bucket that widens holds the newest
  // of the two it was made of: what was kept stays the candidate.
  constexpr int kBucketsAbovePin = 8;
  std::vector<int>& steps = index_[layer];
  if (steps.empty()) return;
  int width = 0;
  if (pinned_step_ >= 0) {
    width = 1;
    while (width < (1 << 30) && int64_t{width} * kBucketsAbovePin < steps.back() - pinned_step_) {
      width *= 2;
    }
  }
  int last_bucket = -1;
  std::set<std::string> kept_uploaders;
  size_t kept = 0, others = 0;
  bool pinned_kept = false;
  std::vector<int> keep;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    const std::string& by = uploaders_[{layer, *it}];
    if (kept < static_cast<size_t>(keep_)) {
      ++kept;
      pinned_kept = pinned_kept || *it <= pinned_step_;
      if (width > 0) last_bucket = *it / width;
    } else if (width > 0 && *it > pinned_step_ && *it / width != last_bucket) {
      last_bucket = *it / width;  // the newest of its bucket
    } else if (!pinned_kept && *it <= pinned_step_) {
      pinned_kept = true;  // the newest at or before the pin
    } else if (others < kOtherUploaders && kept_uploaders.count(by) == 0) {
      ++others;
    } else {
      std::remove(PathOf(layer, *it).c_str());
      uploaders_.erase({layer, *it});
      continue;
    }
    kept_uploaders.insert(by);
    keep.push_back(*it);
  }
  steps.assign(keep.rbegin(), keep.rend());
}

absl::Status CheckpointStore::Save(const v1::LayerCheckpoint& checkpoint) {
  ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                   BeginSave(LayerStateHeader(checkpoint), checkpoint.payload().size()));
  RETURN_IF_ERROR(writer->Append(checkpoint.payload()));
  return writer->Commit();
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointStore::OpenFile(int layer,
                                                                            int step) const {
  const std::string path = PathOf(layer, step);
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) return absl::NotFoundError("cannot open");
  auto reader = std::unique_ptr<CheckpointReader>(new CheckpointReader());
  reader->fd_ = fd;  // closed by the reader from here on
  struct stat info;
  if (fstat(fd, &info) != 0) return ErrnoError("stat");
  const uint64_t size = static_cast<uint64_t>(info.st_size);
  char frame[kFileFrameBytes];
  if (size < kFileFrameBytes) return absl::DataLossError("not a checkpoint file (too short)");
  RETURN_IF_ERROR(ReadAt(fd, 0, kFileFrameBytes, frame));
  if (std::memcmp(frame, kLegacyMagic, kMagicBytes) == 0) {
    // The old format is a serialized whole: read it whole.
    std::string data(static_cast<size_t>(size), '\0');
    RETURN_IF_ERROR(ReadAt(fd, 0, data.size(), data.data()));
    ASSIGN_OR_RETURN(v1::LayerCheckpoint whole, ParseCheckpointFile(data));
    reader->legacy_payload_ = std::move(*whole.mutable_payload());
    whole.clear_payload();
    reader->header_ = std::move(whole);
    reader->payload_bytes_ = reader->legacy_payload_.size();
    close(fd);
    reader->fd_ = -1;
  } else {
    if (std::memcmp(frame, kMagic, kMagicBytes) != 0) {
      return absl::DataLossError("not a checkpoint file (bad magic)");
    }
    const uint32_t crc = ReadLittleEndian<uint32_t>(frame + kMagicBytes);
    const uint64_t header_bytes = ReadLittleEndian<uint64_t>(frame + kMagicBytes + 4);
    if (header_bytes > size - kFileFrameBytes || header_bytes > kMaxHeaderBytes) {
      return absl::DataLossError(absl::StrCat("header of ", header_bytes, " bytes in a file of ",
                                              size));
    }
    // The whole file's checksum, a megabyte at a time, before any of it is used.
    uint32_t actual = 0;
    std::string buffer(kIoBytes, '\0');
    for (uint64_t offset = kFileFrameBytes; offset < size;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kIoBytes, size - offset));
      RETURN_IF_ERROR(ReadAt(fd, offset, n, buffer.data()));
      actual = Crc32Update(actual, absl::string_view(buffer.data(), n));
      offset += n;
    }
    if (actual != crc) return absl::DataLossError("checksum mismatch");
    buffer.resize(static_cast<size_t>(header_bytes));
    RETURN_IF_ERROR(ReadAt(fd, kFileFrameBytes, buffer.size(), buffer.data()));
    if (!reader->header_.ParseFromString(buffer) || !reader->header_.payload().empty()) {
      return absl::DataLossError("header does not parse");
    }
    reader->file_offset_ = kFileFrameBytes + header_bytes;
    reader->payload_bytes_ = size - reader->file_offset_;
  }
  if (reader->header_.layer() != layer || reader->header_.step() != step) {
    return absl::DataLossError(absl::StrCat("holds layer ", reader->header_.layer(), " step ",
                                            reader->header_.step(), ", not what its name says"));
  }
  return reader;
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointStore::OpenLatest(
    int layer, std::vector<std::string>* skipped) {
  std::vector<int> steps;
  {
    absl::MutexLock lock(&mu_);
    auto found = index_.find(layer);
    if (found != index_.end()) steps = found->second;
  }
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    absl::StatusOr<std::unique_ptr<CheckpointReader>> reader = OpenFile(layer, *it);
    if (reader.ok()) return reader;
    if (skipped != nullptr) {
      skipped->push_back(absl::StrCat(PathOf(layer, *it), ": ", reader.status().message()));
    }
  }
  return absl::NotFoundError(absl::StrCat("no intact checkpoint of layer ", layer));
}

absl::StatusOr<int> CheckpointStore::Quarantine(const std::string& uploader) {
  {
    // Before the index is read: a commit either is in it (and moves below)
    // or sees this and is refused.
    absl::MutexLock lock(&mu_);
    quarantined_.insert(uploader);
  }
  int moved = 0;
  for (const auto& [layer, steps] : Index()) {
    for (int step : steps) {
      {
        absl::StatusOr<std::unique_ptr<CheckpointReader>> reader = OpenFile(layer, step);
        if (!reader.ok() || (*reader)->header().worker_id() != uploader) continue;
      }
      absl::MutexLock lock(&mu_);
      RETURN_IF_ERROR(MoveToQuarantineLocked(
          layer, step, absl::StrFormat("layer-%04d-step-%08d.ckpt", layer, step)));
      ++moved;
    }
  }
  return moved;
}

absl::Status CheckpointStore::MoveToQuarantineLocked(int layer, int step,
                                                    const std::string& name) {
  RETURN_IF_ERROR(MakeDir(QuarantineDir()));
  const std::string from = PathOf(layer, step);
  const std::string to = absl::StrCat(QuarantineDir(), "/", name);
  if (rename(from.c_str(), to.c_str()) != 0) return ErrnoError("rename " + from);
  std::vector<int>& kept = index_[layer];
  kept.erase(std::remove(kept.begin(), kept.end(), step), kept.end());
  uploaders_.erase({layer, step});
  return absl::OkStatus();
}

void CheckpointStore::PinAtOrBefore(int step) {
  absl::MutexLock lock(&mu_);
  pinned_step_ = step;
}

absl::StatusOr<CheckpointStore::Rollback> CheckpointStore::RollBackTo(int trusted_step,
                                                                      int num_layers) {
  if (num_layers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("a rollback of ", num_layers, " layers"));
  }
  absl::MutexLock lock(&mu_);
  ++rollbacks_;  // uploads begun before this fail when they commit
  // The newest step <= trusted_step that every layer has.
  std::set<int> common;
  for (int layer = 0; layer < num_layers; ++layer) {
    std::set<int> here;
    if (auto it = index_.find(layer); it != index_.end()) {
      for (int step : it->second) {
        if (step <= trusted_step && (layer == 0 || common.count(step) > 0)) here.insert(step);
      }
    }
    common = std::move(here);
  }
  Rollback rollback;
  rollback.step = common.empty() ? 0 : *common.rbegin();
  for (auto& [layer, steps] : index_) {
    const std::vector<int> all = steps;
    for (int step : all) {
      if (step <= rollback.step) continue;
      RETURN_IF_ERROR(MoveToQuarantineLocked(
          layer, step,
          absl::StrFormat("layer-%04d-step-%08d.rollback-%d.ckpt", layer, step, rollbacks_)));
      ++rollback.moved;
    }
  }
  // Rolled back, the job trusts nothing after the step it resumes at.
  pinned_step_ = std::min(pinned_step_, rollback.step);
  return rollback;
}

std::string CheckpointStore::QuarantineDir() const { return absl::StrCat(dir_, "/quarantine"); }

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointStore::Open(int layer, int step) {
  {
    absl::MutexLock lock(&mu_);
    auto found = index_.find(layer);
    if (found == index_.end() ||
        std::find(found->second.begin(), found->second.end(), step) == found->second.end()) {
      return absl::NotFoundError(absl::StrCat("no checkpoint of layer ", layer, " at step ", step));
    }
  }
  return OpenFile(layer, step);
}

namespace {

absl::StatusOr<v1::LayerCheckpoint> ReadWhole(CheckpointReader& reader) {
  v1::LayerCheckpoint checkpoint = reader.header();
  std::string* payload = checkpoint.mutable_payload();
  payload->reserve(reader.payload_bytes());
  while (true) {
    ASSIGN_OR_RETURN(size_t n, reader.Read(kIoBytes * 16, payload));
    if (n == 0) break;
  }
  return checkpoint;
}

}  // namespace

absl::StatusOr<v1::LayerCheckpoint> CheckpointStore::LoadLatest(
    int layer, std::vector<std::string>* skipped) {
  ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, OpenLatest(layer, skipped));
  return ReadWhole(*reader);
}

absl::StatusOr<v1::LayerCheckpoint> CheckpointStore::Load(int layer, int step) {
  ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, Open(layer, step));
  return ReadWhole(*reader);
}

std::map<int, std::vector<int>> CheckpointStore::Index() const {
  absl::MutexLock lock(&mu_);
  return index_;
}

}  // namespace geotrain
