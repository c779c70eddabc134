#include "worker/datasets.h"

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/model_profile.h"
#include "common/token_file.h"

namespace geotrain {
namespace {

uint64_t MixSeed(uint64_t seed, uint64_t stream, uint64_t index) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ (stream << 48) ^ index;
  x ^= x >> 33;
  x *= 0xFF51AFD7ED558CCDull;
  x ^= x >> 33;
  return x;
}

// Byte-level language modelling over a text corpus: windows of `context`
// bytes, targets shifted by one.
class TextDataset : public Dataset {
 public:
  TextDataset(const v1::JobSpec& job, std::string text)
      : seed_(job.seed()),
        batch_(job.microbatch_size()),
        context_(ContextOf(job)),
        eval_batches_(job.eval_batches()) {
    const int64_t total = static_cast<int64_t>(text.size());
    const int64_t val = static_cast<int64_t>(total * job.text().validation_fraction());
    bytes_ = torch::empty({total}, torch::kUInt8);
    std::memcpy(bytes_.data_ptr(), text.data(), text.size());
    train_ = bytes_.slice(0, 0, total - val);
    val_ = bytes_.slice(0, total - val, total);
  }

  Batch TrainMicrobatch(int64_t index) override {
    return Windows(train_, MixSeed(seed_, 1, index));
  }
  Batch EvalMicrobatch(int64_t index) override {
    return Windows(val_, MixSeed(seed_, 2, index));
  }
  int64_t num_eval_microbatches() const override { return eval_batches_; }

 private:
  Batch Windows(const torch::Tensor& source, uint64_t seed) {
    std::mt19937_64 rng(seed);
    const uint64_t span = static_cast<uint64_t>(source.size(0) - context_ - 1);
    std::vector<torch::Tensor> windows;
    for (int64_t b = 0; b < batch_; ++b) {
      windows.push_back(source.slice(0, rng() % span).slice(0, 0, context_ + 1));
    }
    torch::Tensor all = torch::stack(windows).to(torch::kInt64);
    return {all.slice(1, 0, context_).contiguous(),
            all.slice(1, 1, context_ + 1).contiguous()};
  }

  uint64_t seed_;
  int64_t batch_, context_, eval_batches_;
  torch::Tensor bytes_, train_, val_;
};

// Token files (TokenFile: mapped, ids checked at open): windows of
// `context` + 1 tokens at offsets drawn from (seed, index), targets shifted
// by one, as for text.
class TokenDataset : public Dataset {
 public:
  TokenDataset(const v1::JobSpec& job, TokenFile train, TokenFile validation)
      : seed_(job.seed()),
        batch_(job.microbatch_size()),
        context_(ContextOf(job)),
        eval_batches_(job.eval_batches()),
        train_(std::move(train)),
        validation_(std::move(validation)) {}

  Batch TrainMicrobatch(int64_t index) override {
    return Windows(train_, MixSeed(seed_, 1, index));
  }
  Batch EvalMicrobatch(int64_t index) override {
    return Windows(validation_, MixSeed(seed_, 2, index));
  }
  int64_t num_eval_microbatches() const override { return eval_batches_; }

 private:
  Batch Windows(const TokenFile& source, uint64_t seed) const {
    std::mt19937_64 rng(seed);
    const uint64_t span = static_cast<uint64_t>(source.size() - context_ - 1) + 1;
    torch::Tensor all = torch::empty({batch_, context_ + 1}, torch::kInt64);
    int64_t* out = all.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch_; ++b) {
      source.Copy(static_cast<int64_t>(rng() % span), context_ + 1, out + b * (context_ + 1));
    }
    return {all.slice(1, 0, context_).contiguous(), all.slice(1, 1, context_ + 1).contiguous()};
  }

  uint64_t seed_;
  int64_t batch_, context_, eval_batches_;
  TokenFile train_, validation_;
};

// Fashion-MNIST: 60k training and 10k test images of 28x28, 10 classes.
// Training walks a fresh permutation of the training set every epoch.
class FashionMnistDataset : public Dataset {
 public:
  FashionMnistDataset(const v1::JobSpec& job, torch::Tensor train_images,
                      torch::Tensor train_labels, torch::Tensor test_images,
                      torch::Tensor test_labels)
      : seed_(job.seed()),
        batch_(job.microbatch_size()),
        eval_batches_(job.eval_batches()),
        train_images_(Normalize(train_images)),
        train_labels_(train_labels),
        test_images_(Normalize(test_images)),
        test_labels_(test_labels) {}

  Batch TrainMicrobatch(int64_t index) override {
    const int64_t n = train_images_.size(0);
    std::vector<int64_t> rows(batch_);
    for (int64_t b = 0; b < batch_; ++b) {
      const int64_t sample = index * batch_ + b;
      rows[b] = Permutation(sample / n)[sample % n];
    }
    torch::Tensor idx = torch::tensor(rows, torch::kInt64);
    return {train_images_.index_select(0, idx), train_labels_.index_select(0, idx)};
  }
  Batch EvalMicrobatch(int64_t index) override {
    const int64_t begin = index * batch_;
    const int64_t end = std::min<int64_t>(begin + batch_, test_images_.size(0));
    return {test_images_.slice(0, begin, end), test_labels_.slice(0, begin, end)};
  }
  int64_t num_eval_microbatches() const override {
    const int64_t all = (test_images_.size(0) + batch_ - 1) / batch_;
    return std::min(all, eval_batches_);
  }

 private:
  static torch::Tensor Normalize(const torch::Tensor& images) {
    return ((images.to(torch::kFloat32) / 255.0) - 0.2860) / 0.3530;
  }
  const std::vector<int64_t>& Permutation(int64_t epoch) {
    if (epoch != perm_epoch_) {
      perm_.resize(train_images_.size(0));
      std::iota(perm_.begin(), perm_.end(), 0);
      std::mt19937_64 rng(MixSeed(seed_, 3, epoch));
      // Fisher-Yates with our own index draws: std::shuffle's use of the
      // engine is implementation-defined.
      for (size_t i = perm_.size() - 1; i > 0; --i) {
        std::swap(perm_[i], perm_[rng() % (i + 1)]);
      }
      perm_epoch_ = epoch;
    }
    return perm_;
  }

  uint64_t seed_;
  int64_t batch_, eval_batches_;
  torch::Tensor train_images_, train_labels_, test_images_, test_labels_;
  int64_t perm_epoch_ = -1;
  std::vector<int64_t> perm_;
};

absl::StatusOr<std::string> ReadGzip(const std::string& path) {
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::string out;
  char buffer[1 << 16];
  int n;
  while ((n = gzread(file, buffer, sizeof(buffer))) > 0) out.append(buffer, n);
  const bool failed = n < 0;
  gzclose(file);
  if (failed) return absl::DataLossError(absl::StrCat(path, ": corrupt gzip"));
  return out;
}

uint32_t BigEndian32(const std::string& data, size_t offset) {
  const auto* p = reinterpret_cast<const unsigned char*>(data.data() + offset);
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

// Reads an idx file of unsigned bytes: magic 0x0000 08 NDIM, dims, data.
absl::StatusOr<torch::Tensor> ReadIdx(const std::string& path, int expected_dims) {
  absl::StatusOr<std::string> data = ReadGzip(path);
  if (!data.ok()) return data.status();
  const size_t header = 4 + 4 * expected_dims;
  if (data->size() < header || BigEndian32(*data, 0) != (0x0800u | expected_dims)) {
    return absl::DataLossError(absl::StrCat(path, ": not an idx file of ",
                                            expected_dims, " dimension(s)"));
  }
  std::vector<int64_t> shape;
  size_t count = 1;
  for (int d = 0; d < expected_dims; ++d) {
    shape.push_back(BigEndian32(*data, 4 + 4 * d));
    count *= shape.back();
  }
  if (data->size() != header + count) {
    return absl::DataLossError(absl::StrCat(path, ": size does not match its header"));
  }
  torch::Tensor out = torch::empty(shape, torch::kUInt8);
  std::memcpy(out.data_ptr(), data->data() + header, count);
  if (expected_dims == 3) out = out.reshape({shape[0], shape[1] * shape[2]});
  return expected_dims == 3 ? out : out.to(torch::kInt64);
}

absl::StatusOr<std::string> ReadCorpus(const v1::TextData& text) {
  std::vector<std::string> files;
  for (const std::string& path : text.paths()) {
    std::error_code error;
    if (std::filesystem::is_directory(path, error)) {
      for (const auto& entry : std::filesystem::directory_iterator(path, error)) {
        if (entry.is_regular_file() && !entry.is_symlink() &&
            !entry.path().has_extension()) {
          files.push_back(entry.path().string());
        }
      }
    } else if (std::filesystem::is_regular_file(path, error)) {
      files.push_back(path);
    } else {
      return absl::NotFoundError(absl::StrCat(
          "text data ", path, " not found (install the `fortunes` package?)"));
    }
  }
  std::sort(files.begin(), files.end());
  std::string corpus;
  for (const std::string& file : files) {
    std::ifstream in(file, std::ios::binary);
    std::stringstream buffer;
    buffer << in.rdbuf();
    corpus += buffer.str();
  }
  return corpus;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Dataset>> OpenDataset(const v1::JobSpec& job) {
  if (job.has_tokens()) {
    const v1::TokenData& tokens = job.tokens();
    const int width = tokens.dtype() == v1::TokenData::UINT32 ? 4 : 2;
    // A window is context + 1 tokens.
    const int64_t min_tokens = int64_t{ContextOf(job)} + 1;
    absl::StatusOr<TokenFile> train =
        TokenFile::Open(tokens.train(), width, VocabOf(job), min_tokens);
    if (!train.ok()) return train.status();
    absl::StatusOr<TokenFile> validation =
        TokenFile::Open(tokens.validation(), width, VocabOf(job), min_tokens);
    if (!validation.ok()) return validation.status();
    return std::unique_ptr<Dataset>(
        new TokenDataset(job, *std::move(train), *std::move(validation)));
  }
  if (job.has_text()) {
    absl::StatusOr<std::string> corpus = ReadCorpus(job.text());
    if (!corpus.ok()) return corpus.status();
    const double needed = (ContextOf(job) + 2) / job.text().validation_fraction();
    if (corpus->size() < needed) {
      return absl::FailedPreconditionError(absl::StrCat(
          "text corpus of ", corpus->size(), " bytes is too small for context ",
          ContextOf(job)));
    }
    return std::unique_ptr<Dataset>(new TextDataset(job, *std::move(corpus)));
  }
  const std::string dir = job.fashion_mnist().dir();
  absl::StatusOr<torch::Tensor> train_images = ReadIdx(dir + "/train-images-idx3-ubyte.gz", 3);
  if (!train_images.ok()) return train_images.status();
  absl::StatusOr<torch::Tensor> train_labels = ReadIdx(dir + "/train-labels-idx1-ubyte.gz", 1);
  if (!train_labels.ok()) return train_labels.status();
  absl::StatusOr<torch::Tensor> test_images = ReadIdx(dir + "/t10k-images-idx3-ubyte.gz", 3);
  if (!test_images.ok()) return test_images.status();
  absl::StatusOr<torch::Tensor> test_labels = ReadIdx(dir + "/t10k-labels-idx1-ubyte.gz", 1);
  if (!test_labels.ok()) return test_labels.status();
  if (train_images->size(0) != train_labels->size(0) ||
      test_images->size(0) != test_labels->size(0) || train_images->size(1) != 784) {
    return absl::DataLossError(absl::StrCat(dir, ": image and label files disagree"));
  }
  return std::unique_ptr<Dataset>(new FashionMnistDataset(
      job, *train_images, *train_labels, *test_images, *test_labels));
}

}  // namespace geotrain
