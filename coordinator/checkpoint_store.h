// Stage checkpoints on disk, one file per (layer, step):
//   <state_dir>/checkpoints/layer-0003/step-00000120.ckpt
// A file is "GTCKPT01", then a little-endian uint32 CRC-32 and uint64 length
// of the body, then the body (a serialized LayerCheckpoint). Files are
// written atomically (temp file, fsync, rename, fsync of the directory), the
// newest `keep` per layer are kept, and the directory itself is the index,
// so a restarted coordinator finds every checkpoint without other state.
// A file whose magic, length, checksum or body does not check out is passed
// over (and named) in favour of the previous one.
//
// Thread-safe; saves and loads of different layers may run concurrently
// with everything else (the controller's lock is not held for disk I/O).
#ifndef GEOTRAIN_COORDINATOR_CHECKPOINT_STORE_H_
#define GEOTRAIN_COORDINATOR_CHECKPOINT_STORE_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "geotrain/v1/coordinator.pb.h"
#include "geotrain/v1/job.pb.h"

namespace geotrain {

// OK when `checkpoint` fits the job's model: one of its layers, a step in
// [0, job.steps], float32 parameters whose element counts add up to the
// layer's (ProfileLayers), optimizer state that repeats the parameters'
// shapes state_per_param (0-2) times, a payload of exactly their bytes, and
// every value finite. INVALID_ARGUMENT saying what does not fit.
absl::Status CheckLayerCheckpoint(const v1::JobSpec& job, const v1::LayerCheckpoint& checkpoint);

// The file format (see above): FormatCheckpointFile writes it,
// ParseCheckpointFile checks magic, length and CRC and parses the body
// (DATA_LOSS saying what is wrong).
std::string FormatCheckpointFile(const v1::LayerCheckpoint& checkpoint);
absl::StatusOr<v1::LayerCheckpoint> ParseCheckpointFile(const std::string& data);

class CheckpointStore {
 public:
  // Creates <state_dir>/checkpoints if needed.
  static absl::StatusOr<std::unique_ptr<CheckpointStore>> Open(const std::string& state_dir,
                                                               int keep = 3);

  // INVALID_ARGUMENT for a negative layer or step.
  absl::Status Save(const v1::LayerCheckpoint& checkpoint);

  // The newest intact checkpoint of `layer`; NOT_FOUND when there is none.
  // Each corrupt file passed over is appended to `*skipped` (path: reason).
  absl::StatusOr<v1::LayerCheckpoint> LoadLatest(int layer, std::vector<std::string>* skipped);

  // The checkpoint of `layer` at `step`: NOT_FOUND when there is none,
  // DATA_LOSS when its file does not check out.
  absl::StatusOr<v1::LayerCheckpoint> Load(int layer, int step);

  // Layer -> steps on disk, oldest first. In memory: cheap enough for
  // every status query.
  std::map<int, std::vector<int>> Index() const;

  const std::string& dir() const { return dir_; }

 private:
  CheckpointStore(std::string dir, int keep) : dir_(std::move(dir)), keep_(keep) {}
  std::string LayerDir(int layer) const;
  std::string PathOf(int layer, int step) const;
  std::vector<int> StepsOnDisk(int layer) const;
  void ScanLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string dir_;
  const int keep_;
  mutable absl::Mutex mu_;  // one writer at a time per store; reads take it too
  std::map<int, std::vector<int>> index_ ABSL_GUARDED_BY(mu_);
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_CHECKPOINT_STORE_H_
