#include "coordinator/tensorboard_writer.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "common/tf_record.h"
#include "geotrain/tensorboard/event.pb.h"

namespace geotrain {
namespace {

std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

double UnixSeconds(absl::Time t) { return absl::ToDoubleSeconds(t - absl::UnixEpoch()); }

}  // namespace

absl::StatusOr<std::unique_ptr<TensorBoardWriter>> TensorBoardWriter::Open(
    const std::string& dir) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) {
    return absl::UnavailableError(
        absl::StrCat("cannot create the TensorBoard directory ", dir, ": ", error.message()));
  }
  const absl::Time now = absl::Now();
  AppendLogOptions options;
  options.path = absl::StrCat(dir, "/events.out.tfevents.", absl::ToUnixSeconds(now), ".",
                              HostName(), ".", getpid(), ".geotrain");
  options.truncate = true;
  options.binary_records = true;
  absl::StatusOr<std::unique_ptr<AppendLog>> file = AppendLog::Open(options);
  if (!file.ok()) return file.status();
  std::unique_ptr<TensorBoardWriter> writer(
      new TensorBoardWriter(options.path, *std::move(file)));
  tensorboard::Event version;
  version.set_wall_time(UnixSeconds(now));
  version.set_file_version("brain.Event:2");
  writer->file_->Append(TfRecord(version.SerializeAsString()));
  return writer;
}

void TensorBoardWriter::Write(int64_t step, absl::Time wall_time, const Scalars& scalars) {
  tensorboard::Event event;
  event.set_wall_time(UnixSeconds(wall_time));
  event.set_step(step);
  tensorboard::Summary* summary = event.mutable_summary();
  for (const auto& [tag, value] : scalars) {
    if (!std::isfinite(value)) continue;
    tensorboard::SummaryValue* point = summary->add_value();
    point->set_tag(tag);
    point->set_simple_value(static_cast<float>(value));
  }
  if (summary->value_size() == 0) return;
  file_->Append(TfRecord(event.SerializeAsString()));
}

void TensorBoardWriter::Flush() { file_->Flush(); }

}  // namespace geotrain
