// Stage checkpoints on disk, one file per (layer, step):
//   <state_dir>/checkpoints/layer-0003/step-00000120.ckpt
// A file is "GTCKPT02", a little-endian uint32 CRC-32 of everything after
// the 20-byte frame, a uint64 length of the header, the header (a
// serialized LayerCheckpoint without payload), then the raw payload. Files
// are streamed in (CheckpointWriter) and out (CheckpointReader) a chunk at
// a time, so no layer is held in memory whole; they are written atomically
// (temp file, fsync, rename, fsync of the directory), the newest `keep` per
// layer are kept (and the newest of a few other uploaders besides, see
// PruneLocked), and the directory itself is the index, so a restarted
// coordinator finds every checkpoint without other state. Files of the
// previous format ("GTCKPT01": CRC, length, a whole serialized
// LayerCheckpoint) are still read. A file whose magic, length, checksum or
// header does not check out is passed over (and named) in favour of the
// previous one.
//
// Thread-safe; saves and loads of different layers may run concurrently
// with everything else (the controller's lock is not held for disk I/O).
#ifndef GEOTRAIN_COORDINATOR_CHECKPOINT_STORE_H_
#define GEOTRAIN_COORDINATOR_CHECKPOINT_STORE_H_

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "geotrain/v1/coordinator.pb.h"
#include "geotrain/v1/job.pb.h"

namespace geotrain {

// OK when a checkpoint with this header (no payload) and `payload_bytes`
// fits the job's model: everything CheckLayerCheckpoint checks except the
// values themselves (the upload checks those chunk by chunk:
// CheckFiniteFloats).
absl::Status CheckLayerCheckpointHeader(const v1::JobSpec& job, const v1::LayerCheckpoint& header,
                                        uint64_t payload_bytes);

// INVALID_ARGUMENT naming `what` when `data` (float32 values, a multiple of
// 4 bytes) holds a NaN or an infinity.
absl::Status CheckFiniteFloats(absl::string_view data, const std::string& what);

// OK when `checkpoint` fits the job's model: one of its layers, a step in
// [0, job.steps], float32 parameters of exactly the layer's shapes in its
// order (LayerParameters), optimizer state that repeats the parameters'
// shapes state_per_param (0-2) times, a payload of exactly their bytes, and
// every value finite. INVALID_ARGUMENT saying what does not fit.
absl::Status CheckLayerCheckpoint(const v1::JobSpec& job, const v1::LayerCheckpoint& checkpoint);

// The file format (see above): FormatCheckpointFile writes it,
// ParseCheckpointFile checks magic, length and CRC and parses the body
// (DATA_LOSS saying what is wrong).
std::string FormatCheckpointFile(const v1::LayerCheckpoint& checkpoint);
absl::StatusOr<v1::LayerCheckpoint> ParseCheckpointFile(const std::string& data);

class CheckpointStore;

// One checkpoint file being written: Append the payload in order, then
// Commit (the checkpoint becomes visible atomically). Destroyed without a
// Commit, it leaves nothing behind. Not thread-safe.
class CheckpointWriter {
 public:
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;
  ~CheckpointWriter();

  // INVALID_ARGUMENT past the payload size given to BeginSave.
  absl::Status Append(absl::string_view data);
  // FAILED_PRECONDITION unless exactly the announced bytes were appended.
  absl::Status Commit();

 private:
  friend class CheckpointStore;
  CheckpointWriter(CheckpointStore* store, int layer, int step, std::string uploader,
                   std::string tmp, int fd, uint64_t payload_bytes, uint64_t rollbacks)
      : store_(store), layer_(layer), step_(step), uploader_(std::move(uploader)),
        tmp_(std::move(tmp)), fd_(fd), payload_bytes_(payload_bytes), rollbacks_(rollbacks) {}
  CheckpointStore* store_;
  const int layer_, step_;
  const std::string uploader_;
  const std::string tmp_;
  int fd_;
  const uint64_t payload_bytes_;
  const uint64_t rollbacks_;  // the store's rollbacks when it began
  uint64_t written_ = 0;
  uint32_t crc_ = 0;
  bool committed_ = false;
};

// One checked checkpoint file open for reading: the header at once, the
// payload a piece at a time. The file was checked whole (checksum) when it
// was opened. Not thread-safe.
class CheckpointReader {
 public:
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;
  ~CheckpointReader();

  const v1::LayerCheckpoint& header() const { return header_; }  // payload empty
  uint64_t payload_bytes() const { return payload_bytes_; }
  // Appends the next min(max_bytes, what is left) payload bytes to `*out`
  // and returns how many (0 at the end). UNAVAILABLE on a read error.
  absl::StatusOr<size_t> Read(size_t max_bytes, std::string* out);

 private:
  friend class CheckpointStore;
  CheckpointReader() = default;
  v1::LayerCheckpoint header_;
  uint64_t payload_bytes_ = 0;
  uint64_t offset_ = 0;  // of the payload already read
  int fd_ = -1;          // -1: a file of the old format, held in legacy_payload_
  uint64_t file_offset_ = 0;
  std::string legacy_payload_;
};

class CheckpointStore {
 public:
  // Creates <state_dir>/checkpoints if needed.
  static absl::StatusOr<std::unique_ptr<CheckpointStore>> Open(const std::string& state_dir,
                                                               int keep = 3);

  // INVALID_ARGUMENT for a negative layer or step.
  absl::Status Save(const v1::LayerCheckpoint& checkpoint);
  // A file for `header` (its payload must be empty) and `payload_bytes` to
  // come. Concurrent writers of the same (layer, step): the last to commit
  // wins.
  absl::StatusOr<std::unique_ptr<CheckpointWriter>> BeginSave(const v1::LayerCheckpoint& header,
                                                              uint64_t payload_bytes);

  // As LoadLatest and Load, but streaming.
  absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenLatest(int layer,
                                                               std::vector<std::string>* skipped);
  absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(int layer, int step);

  // The newest intact checkpoint of `layer`; NOT_FOUND when there is none.
  // Each corrupt file passed over is appended to `*skipped` (path: reason).
  absl::StatusOr<v1::LayerCheckpoint> LoadLatest(int layer, std::vector<std::string>* skipped);

  // The checkpoint of `layer` at `step`: NOT_FOUND when there is none,
  // DATA_LOSS when its file does not check out.
  absl::StatusOr<v1::LayerCheckpoint> Load(int layer, int step);

  // Moves every checkpoint that `uploader` wrote (its header's worker_id)
  // out of the index into <checkpoints>/quarantine/, where an operator can
  // still look at it; restores then use the newest of the others. Returns
  // how many files moved. For a worker whose word is no longer trusted
  // (revoked, evicted). An upload of theirs still in flight goes to the
  // quarantine too when it commits (its Commit fails): the index never
  // names their files again while this store lives (a restart's revoked
  // certificate refuses their uploads).
  absl::StatusOr<int> Quarantine(const std::string& uploader);

  // Each layer's newest checkpoint at or before `step` is kept however old
  // it gets (besides what PruneLocked keeps): the state a rollback goes
  // back to (RollBackTo). `step` should not decrease between rollbacks; a
  // checkpoint pruned before it was pinned is gone. -1: nothing pinned.
  void PinAtOrBefore(int step);

  // What RollBackTo did.
  struct Rollback {
    int step = 0;     // the checkpoints the job goes back to (0: the seed's)
    int moved = 0;    // files moved into quarantine
  };
  // Rolls the store back for a job of `num_layers` layers whose
  // computations are trusted up to `trusted_step`: finds the newest step
  // at or before it at which every layer has a checkpoint (0 when there is
  // none: the layers start from the seed) and moves every checkpoint after
  // it into quarantine/, so that restores take exactly that step's. An
  // upload begun before the rollback is refused when it commits (it was
  // computed from what is being rolled back). INVALID_ARGUMENT for
  // num_layers < 1.
  absl::StatusOr<Rollback> RollBackTo(int trusted_step, int num_layers);

  // Layer -> steps on disk, oldest first. In memory: cheap enough for
  // every status query.
  std::map<int, std::vector<int>> Index() const;

  // When the file of (`layer`, `step`) was written; nullopt without one.
  std::optional<absl::Time> WrittenAt(int layer, int step) const;

  const std::string& dir() const { return dir_; }

 private:
  CheckpointStore(std::string dir, int keep) : dir_(std::move(dir)), keep_(keep) {}
  std::string LayerDir(int layer) const;
  std::string QuarantineDir() const;
  std::string PathOf(int layer, int step) const;
  std::vector<int> StepsOnDisk(int layer) const;
  absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenFile(int layer, int step) const;
  void ScanLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Renames the writer's file into place and updates the index.
  absl::Status CommitFile(const std::string& tmp, int layer, int step,
                          const std::string& uploader, uint64_t rollbacks);
  // Moves (layer, step)'s file to quarantine/ as `name` and out of the index.
  absl::Status MoveToQuarantineLocked(int layer, int step, const std::string& name)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes a layer's files beyond what is kept: the newest `keep_`, the
  // newest of each of up to kOtherUploaders uploaders besides theirs, so
  // that a worker's quarantine leaves somebody else's to restore, and the
  // pinned one (PinAtOrBefore).
  void PruneLocked(int layer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  friend class CheckpointWriter;

  const std::string dir_;
  const int keep_;
  mutable absl::Mutex mu_;  // one writer at a time per store; reads take it too
  std::map<int, std::vector<int>> index_ ABSL_GUARDED_BY(mu_);
  // (layer, step) -> the worker that uploaded it ("" unknown).
  std::map<std::pair<int, int>, std::string> uploaders_ ABSL_GUARDED_BY(mu_);
  uint64_t next_temp_ ABSL_GUARDED_BY(mu_) = 0;
  // Uploaders whose checkpoints were quarantined.
  std::set<std::string> quarantined_ ABSL_GUARDED_BY(mu_);
  int pinned_step_ ABSL_GUARDED_BY(mu_) = -1;  // PinAtOrBefore
  uint64_t rollbacks_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_CHECKPOINT_STORE_H_
