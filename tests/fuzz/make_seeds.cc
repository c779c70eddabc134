// Writes the seed corpora in corpus/<target>/ (run once by hand when a
// format changes: build-fuzz/bin/make_fuzz_seeds tests/fuzz/corpus). Each
// seed is a valid input of its target, so that the fuzzer starts from the
// paths real traffic takes.
#include <zstd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/codec.h"
#include "common/commitment.h"
#include "common/job_spec.h"
#include "common/join_token.h"
#include "common/link_message.h"
#include "common/model_profile.h"
#include "common/x509.h"
#include "coordinator/checkpoint_store.h"

namespace geotrain {
namespace {

std::string Piece(const std::string& bytes) {
  std::string out;
  out.push_back(static_cast<char>(bytes.size() & 0xff));
  out.push_back(static_cast<char>((bytes.size() >> 8) & 0xff));
  return out + bytes;
}

void Write(const std::string& dir, const std::string& name, const std::string& bytes) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
}

v1::TensorHeader Raw(const TensorSpec& spec) {
  v1::TensorHeader h;
  uint64_t n = 1;
  for (int64_t d : spec.shape) {
    h.add_shape(d);
    n *= d;
  }
  h.set_dtype(spec.dtype);
  h.set_codec(v1::CODEC_NONE);
  h.set_payload_bytes(n * DTypeSize(spec.dtype));
  h.set_encoded_bytes(n * DTypeSize(spec.dtype));
  return h;
}

// Committed as a sender commits (so the fuzzer starts from messages that
// pass the commitment and reach the checks after it).
std::string Frames(LinkMessage message) {
  if (IsCommittedKind(message.header.kind())) {
    message.header.set_commitment(CommitmentOf(message.header, message.payload));
  }
  std::string out;
  // Frames small enough for the 2-byte piece length.
  for (const v1::LinkFrame& frame : SplitIntoFrames(message, 16000)) {
    out += Piece(frame.SerializeAsString());
  }
  return out;
}

void LinkSeeds(const std::string& dir) {
  const v1::JobSpec job = *ParseJobSpec(
      "gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 3 zstd: true", "seed");
  v1::LinkFrame hello;
  hello.mutable_header()->set_kind(v1::MESSAGE_KIND_HELLO);
  hello.mutable_header()->set_epoch(1);
  hello.mutable_header()->set_from_stage(0);
  hello.mutable_header()->set_from_worker("w0");
  hello.set_last(true);
  Write(dir, "hello", Piece(hello.SerializeAsString()));
  const int64_t batch = job.microbatch_size();
  LinkMessage activation;
  activation.header.set_kind(v1::MESSAGE_KIND_ACTIVATION);
  activation.header.set_epoch(1);
  activation.header.set_from_stage(0);
  v1::TensorHeader a = Raw(LayerInputSpec(job, 1, batch));
  *activation.header.add_tensors() = a;
  activation.payload.assign(a.payload_bytes(), '\0');
  v1::TensorHeader t = Raw(TargetSpec(job, batch));
  std::string labels(t.payload_bytes(), '\0');
  for (size_t i = 0; i < labels.size(); i += 8) labels[i] = 65;
  LinkMessage raw = activation;
  *raw.header.add_tensors() = t;
  raw.payload += labels;
  Write(dir, "activation", Piece(hello.SerializeAsString()) + Frames(raw));
  LinkMessage packed = activation;
  std::string zstd(ZSTD_compressBound(labels.size()), '\0');
  zstd.resize(ZSTD_compress(zstd.data(), zstd.size(), labels.data(), labels.size(), 1));
  t.set_zstd(true);
  t.set_payload_bytes(zstd.size());
  *packed.header.add_tensors() = t;
  packed.payload += zstd;
  Write(dir, "activation_zstd_targets", Frames(packed));
  LinkMessage gradient;
  gradient.header.set_kind(v1::MESSAGE_KIND_GRADIENT);
  gradient.header.set_epoch(1);
  v1::TensorHeader g = Raw(LayerInputSpec(job, 3, batch));
  *gradient.header.add_tensors() = g;
  gradient.payload.assign(g.payload_bytes(), '\0');
  Write(dir, "gradient", Frames(gradient));
  LinkMessage done;
  done.header.set_kind(v1::MESSAGE_KIND_DONE);
  done.header.set_epoch(1);
  Write(dir, "done", Frames(done));
  // zstd'd activations (issue 32): a frame that declares the announced
  // size, one that declares none, and a small one that declares 4 GiB.
  const std::string raw_activation(a.payload_bytes(), '\0');
  auto zstd_activation = [&](const std::string& frame) {
    LinkMessage m = activation;
    v1::TensorHeader* z = m.header.mutable_tensors(0);
    z->set_zstd(true);
    z->set_encoded_bytes(a.payload_bytes());
    z->set_payload_bytes(frame.size());
    *m.header.add_tensors() = Raw(TargetSpec(job, batch));
    m.payload = frame + labels;
    return m;
  };
  std::string sized(ZSTD_compressBound(raw_activation.size()), '\0');
  sized.resize(ZSTD_compress(sized.data(), sized.size(), raw_activation.data(),
                             raw_activation.size(), 1));
  Write(dir, "activation_zstd", Frames(zstd_activation(sized)));
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 0);
  std::string unsized(ZSTD_compressBound(raw_activation.size()), '\0');
  ZSTD_outBuffer out{unsized.data(), unsized.size(), 0};
  ZSTD_inBuffer in{raw_activation.data(), raw_activation.size(), 0};
  ZSTD_compressStream2(cctx, &out, &in, ZSTD_e_end);
  ZSTD_freeCCtx(cctx);
  unsized.resize(out.pos);
  Write(dir, "activation_zstd_unsized", Frames(zstd_activation(unsized)));
  std::string huge("\x28\xb5\x2f\xfd\xe0", 5);
  for (int i = 0; i < 8; ++i) huge.push_back(static_cast<char>((uint64_t{4} << 30) >> (8 * i)));
  huge.append("\x01\x00\x00", 3);
  Write(dir, "activation_zstd_declares_4gib", Frames(zstd_activation(huge)));
}

void TensorSeeds(const std::string& dir) {
  std::vector<float> values(256);
  for (size_t i = 0; i < values.size(); ++i) values[i] = std::sin(0.3f * i);
  for (v1::Codec codec : {v1::CODEC_NONE, v1::CODEC_FP16, v1::CODEC_BF16, v1::CODEC_INT8,
                          v1::CODEC_INT4, v1::CODEC_TOPK}) {
    for (bool zstd : {false, true}) {
      CodecOptions options;
      options.topk_fraction = 0.1;
      std::string encoded;
      if (!(*MakeCodec(codec, options))->Encode(values.data(), values.size(), &encoded).ok()) {
        continue;
      }
      v1::TensorHeader h;
      h.add_shape(16);
      h.add_shape(16);
      h.set_dtype(v1::DTYPE_FLOAT32);
      h.set_codec(codec);
      h.set_block_size(64);
      h.set_encoded_bytes(encoded.size());
      std::string payload = encoded;
      if (zstd) {
        payload.assign(ZSTD_compressBound(encoded.size()), '\0');
        payload.resize(ZSTD_compress(payload.data(), payload.size(), encoded.data(),
                                     encoded.size(), 1));
        h.set_zstd(true);
      }
      h.set_payload_bytes(payload.size());
      Write(dir, v1::Codec_Name(codec) + (zstd ? "_zstd" : ""),
            Piece(h.SerializeAsString()) + Piece(payload) + Piece(std::string(16, 'x')));
    }
  }
}

void JobSeeds(const std::string& dir, const std::string& jobs) {
  for (const auto& entry : std::filesystem::directory_iterator(jobs)) {
    std::ifstream in(entry.path());
    std::stringstream text;
    text << in.rdbuf();
    Write(dir, entry.path().filename().string(), text.str());
  }
}

void CheckpointSeeds(const std::string& dir) {
  const v1::JobSpec job =
      *ParseJobSpec("mlp { hidden: 4 hidden: 3 } fashion_mnist {} steps: 100", "seed");
  for (int layer = 0; layer < NumLayers(job); ++layer) {
    v1::LayerCheckpoint c;
    c.set_layer(layer);
    c.set_step(10);
    c.set_state_per_param(2);
    const uint64_t n = ProfileLayers(job)[layer].parameter_count;
    for (int k = 0; k < 3; ++k) {
      v1::TensorHeader* h = k == 0 ? c.add_params() : c.add_optimizer_state();
      h->set_dtype(v1::DTYPE_FLOAT32);
      h->set_codec(v1::CODEC_NONE);
      h->add_shape(n);
      h->set_payload_bytes(4 * n);
      h->set_encoded_bytes(4 * n);
    }
    c.mutable_payload()->assign(12 * n, '\0');
    Write(dir, "body_layer" + std::to_string(layer), std::string(1, '\1') + c.SerializeAsString());
    Write(dir, "file_layer" + std::to_string(layer),
          std::string(1, '\0') + FormatCheckpointFile(c));
  }
}

void TokenSeeds(const std::string& dir) {
  Write(dir, "token", FormatJoinToken(*NewJoinToken("sha256:" + std::string(64, 'a'))) + "\n");
  Write(dir, "csr", *CreateCsrPem(*GeneratePrivateKeyPem(), "seed"));
  Write(dir, "certificate",
        CreateCertificateAuthority("seed", absl::Hours(1))->certificate_pem);
}

}  // namespace
}  // namespace geotrain

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: make_fuzz_seeds CORPUS_DIR JOBS_DIR\n");
    return 2;
  }
  const std::string corpus = argv[1];
  geotrain::LinkSeeds(corpus + "/link_frames_fuzz");
  geotrain::TensorSeeds(corpus + "/tensor_decode_fuzz");
  geotrain::JobSeeds(corpus + "/job_spec_fuzz", argv[2]);
  geotrain::CheckpointSeeds(corpus + "/checkpoint_file_fuzz");
  geotrain::TokenSeeds(corpus + "/token_fuzz");
  return 0;
}
