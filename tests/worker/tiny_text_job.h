// The worker tests' small text job: a corpus of 400 lines written to a file
// of this process's own (ctest runs a binary's tests in parallel), and a
// 4-layer GPT on it (context 16, d_model 32, 4 heads, 2 blocks; 4 steps of
// 2 microbatches of 4; seed 7).
#ifndef GEOTRAIN_TESTS_WORKER_TINY_TEXT_JOB_H_
#define GEOTRAIN_TESTS_WORKER_TINY_TEXT_JOB_H_

#include <unistd.h>

#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "absl/status/statusor.h"
#include "common/job_spec.h"

namespace geotrain {

// Writes the corpus to TempDir()/<name>.<pid>.txt and returns its path.
inline std::string WriteTinyCorpus(const std::string& name) {
  const std::string path =
      testing::TempDir() + "/" + name + "." + std::to_string(getpid()) + ".txt";
  std::ofstream out(path);
  for (int i = 0; i < 400; ++i) out << "the quick brown fox " << i << " jumps over the lazy dog\n";
  return path;
}

inline absl::StatusOr<v1::JobSpec> TinyGptJob(const std::string& corpus) {
  return ParseJobSpec("gpt { context: 16 d_model: 32 heads: 4 blocks: 2 } text { paths: \"" +
                          corpus + "\" } steps: 4 microbatches: 2 microbatch_size: 4 seed: 7",
                      "test");
}

}  // namespace geotrain

#endif  // GEOTRAIN_TESTS_WORKER_TINY_TEXT_JOB_H_
