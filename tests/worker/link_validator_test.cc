#include "worker/link_validator.h"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>

#include <zstd.h>

#include "common/codec.h"
#include "common/commitment.h"
#include "common/job_spec.h"
#include "worker/link_hello.h"
#include "worker/link_service.h"
#include "worker/outer_links.h"
#include "common/model_profile.h"

namespace geotrain {
namespace {

v1::JobSpec Job() {
  return *ParseJobSpec(
      "gpt { context: 4 d_model: 8 heads: 2 blocks: 2 } text {} steps: 1 "
      "microbatch_size: 2",
      "test");
}

void AddTensor(LinkMessage* m, std::vector<int64_t> shape, v1::DType dtype) {
  v1::TensorHeader* t = m->header.add_tensors();
  size_t n = 1;
  for (int64_t d : shape) {
    t->add_shape(d);
    n *= d;
  }
  t->set_dtype(dtype);
  t->set_codec(v1::CODEC_NONE);
  t->set_payload_bytes(n * DTypeSize(dtype));
  m->payload.append(n * DTypeSize(dtype), '\0');
}

// Stage 1 of 3 holds layers [1, 3): its input is a [B, 4, 8] activation and
// its output (what gradients refer to) is also [B, 4, 8].
LinkMessage Activation(std::vector<int64_t> shape = {2, 4, 8},
                       v1::DType dtype = v1::DTYPE_FLOAT32) {
  LinkMessage m;
  m.header.set_kind(v1::MESSAGE_KIND_ACTIVATION);
  m.header.set_epoch(5);
  AddTensor(&m, shape, dtype);
  AddTensor(&m, {shape.empty() ? 0 : shape[0], 4}, v1::DTYPE_INT64);
  return m;
}

// `m` as its sender commits to it, last (common/commitment.h).
LinkMessage Committed(LinkMessage m) {
  if (IsCommittedKind(m.header.kind())) {
    m.header.set_commitment(CommitmentOf(m.header, m.payload));
  }
  return m;
}

v1::LinkHeader Hello(uint64_t epoch, int from_stage) { return MakeHello(epoch, from_stage); }

// A training message is used only with its sender's commitment to exactly
// its header and payload: none, a short one, one to another microbatch, step
// or weight version, or to other bytes is refused. What is not the
// message's content (the receive rate) may change in flight.
TEST(LinkValidatorTest, ATrainingMessageMustCarryItsCommitment) {
  LinkValidator v(Job(), 5, 1, 1, 3);
  EXPECT_EQ(v.CheckFromUpstream(Activation()).code(), absl::StatusCode::kInvalidArgument);
  const LinkMessage committed = Committed(Activation());
  ASSERT_EQ(committed.header.commitment().size(), kCommitmentBytes);
  LinkMessage short_commitment = committed;
  short_commitment.header.set_commitment(committed.header.commitment().substr(0, 16));
  EXPECT_EQ(v.CheckFromUpstream(short_commitment).code(), absl::StatusCode::kInvalidArgument);
  LinkMessage changed_payload = committed;
  changed_payload.payload[3] = 1;
  absl::Status refused = v.CheckFromUpstream(changed_payload);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("commitment"), std::string::npos) << refused;
  for (auto change : std::vector<void (*)(v1::LinkHeader*)>{
           [](v1::LinkHeader* h) { h->set_microbatch(1); },
           [](v1::LinkHeader* h) { h->set_step(2); },
           [](v1::LinkHeader* h) { h->set_weight_version(3); },
           [](v1::LinkHeader* h) { h->add_weight_versions(4); },
           [](v1::LinkHeader* h) { h->set_weights_digest(std::string(32, 'w')); },
           [](v1::LinkHeader* h) { h->mutable_tensors(1)->set_codec(v1::CODEC_FP16); }}) {
    LinkMessage renamed = committed;
    change(&renamed.header);
    EXPECT_NE(CommitmentOf(renamed.header, renamed.payload), committed.header.commitment());
    EXPECT_EQ(v.CheckFromUpstream(renamed).code(), absl::StatusCode::kInvalidArgument);
  }
  LinkMessage rate = committed;
  rate.header.set_receive_rate_bps(1e6);
  EXPECT_TRUE(v.CheckFromUpstream(rate).ok());
  // Only training messages carry one.
  LinkMessage done;
  done.header.set_kind(v1::MESSAGE_KIND_DONE);
  done.header.set_epoch(5);
  done.header.set_commitment(committed.header.commitment());
  EXPECT_EQ(v.CheckFromUpstream(done).code(), absl::StatusCode::kInvalidArgument);
}

// The commitment is a fixed layout's SHA-256, not protobuf bytes: it is the
// same for the same message on every build. The expected value was computed
// apart from this code, with Python's hashlib over the layout that
// common/commitment.cc documents.
TEST(LinkValidatorTest, ACommitmentIsStableAcrossBuilds) {
  LinkMessage m;
  m.header.set_kind(v1::MESSAGE_KIND_GRADIENT);
  m.header.set_epoch(5);
  m.header.set_microbatch(7);
  m.header.set_step(2);
  AddTensor(&m, {2, 4, 8}, v1::DTYPE_FLOAT32);
  EXPECT_EQ(CommitmentHex(CommitmentOf(m.header, m.payload)),
            "7dbe7b9965061b12d25e110493b9e66e166cefef87c06b3fff12908b54aa8240");
  std::string digest;
  for (char c = 0; c < 32; ++c) digest.push_back(c);
  m.header.set_weights_digest(digest);
  EXPECT_EQ(CommitmentHex(CommitmentOf(m.header, m.payload)),
            "7b086435e9b09926083f50b2537a081eabcdb8bb0f71dda644663f2ee6d21881");
  // A stage whose updates are audited also commits to its optimizer state
  // and its count of weight syncs.
  std::string state_digest;
  for (char c = 32; c < 64; ++c) state_digest.push_back(c);
  m.header.set_state_digest(state_digest);
  m.header.set_weight_syncs(3);
  EXPECT_EQ(CommitmentHex(CommitmentOf(m.header, m.payload)),
            "3c69df73397ba1eea715f89bdad9764d7bfc814434a298e4505ab334d86e3174");
}

TEST(LinkValidatorTest, AcceptsWhatThePlanImplies) {
  LinkValidator v(Job(), 5, 1, 1, 3);
  EXPECT_TRUE(v.CheckFromUpstream(Committed(Activation())).ok());
  EXPECT_TRUE(v.CheckFromUpstream(Committed(Activation({1, 4, 8}))).ok()) << "short last batch";
  EXPECT_TRUE(v.CheckHello(Hello(5, 0)).ok());
  LinkMessage done;
  done.header.set_kind(v1::MESSAGE_KIND_DONE);
  done.header.set_epoch(5);
  EXPECT_TRUE(v.CheckFromUpstream(Committed(done)).ok());
  LinkMessage grad;
  grad.header.set_kind(v1::MESSAGE_KIND_GRADIENT);
  grad.header.set_epoch(5);
  AddTensor(&grad, {2, 4, 8}, v1::DTYPE_FLOAT32);
  EXPECT_TRUE(v.CheckFromDownstream(Committed(grad)).ok());
}

TEST(LinkValidatorTest, RefusesHelloOfWrongEpochOrStage) {
  LinkValidator v(Job(), 5, 1, 1, 3);
  EXPECT_EQ(v.CheckHello(Hello(4, 0)).code(), absl::StatusCode::kInvalidArgument);
  // A newer epoch: the dialler saw the plan first; it may try again.
  EXPECT_EQ(v.CheckHello(Hello(6, 0)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(v.CheckHello(Hello(5, 1)).code(), absl::StatusCode::kInvalidArgument);
  v1::LinkHeader not_hello = Hello(5, 0);
  not_hello.set_kind(v1::MESSAGE_KIND_ACTIVATION);
  EXPECT_EQ(v.CheckHello(not_hello).code(), absl::StatusCode::kInvalidArgument);
}

TEST(LinkValidatorTest, AcceptsHellosOnlyFromTheUpstreamStagesWorkers) {
  // Stage 0 has a primary and a replica.
  LinkValidator v(Job(), 5, 1, 1, 3, {"w0", "w4"});
  EXPECT_TRUE(v.CheckHello(MakeHello(5, 0, "w0")).ok());
  EXPECT_TRUE(v.CheckHello(MakeHello(5, 0, "w4")).ok());
  absl::Status stranger = v.CheckHello(MakeHello(5, 0, "w9"));
  EXPECT_EQ(stranger.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(stranger.message().find("w9"), std::string::npos) << stranger;
  // Without an id it is refused, with two upstream workers or with one: an
  // anonymous link could not be told from the real one (a stranger's DONE
  // on it once ended the last stage).
  EXPECT_EQ(v.CheckHello(MakeHello(5, 0)).code(), absl::StatusCode::kInvalidArgument);
  LinkValidator single(Job(), 5, 1, 1, 3, {"w0"});
  EXPECT_EQ(single.CheckHello(MakeHello(5, 0)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(single.CheckHello(MakeHello(5, 0, "w0")).ok());
  EXPECT_EQ(single.CheckHello(MakeHello(5, 0, "w9")).code(), absl::StatusCode::kInvalidArgument);
}

TEST(LinkValidatorTest, RefusesWrongShapeDtypeEpochKindAndValues) {
  LinkValidator v(Job(), 5, 1, 1, 3);
  EXPECT_EQ(v.CheckFromUpstream(Committed(Activation({2, 4, 9}))).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(v.CheckFromUpstream(Committed(Activation({3, 4, 8}))).code(), absl::StatusCode::kInvalidArgument)
      << "batch above microbatch_size";
  EXPECT_EQ(v.CheckFromUpstream(Committed(Activation({2, 4, 8}, v1::DTYPE_INT64))).code(),
            absl::StatusCode::kInvalidArgument);
  LinkMessage old_epoch = Activation();
  old_epoch.header.set_epoch(4);
  EXPECT_EQ(v.CheckFromUpstream(Committed(old_epoch)).code(), absl::StatusCode::kInvalidArgument);
  LinkMessage gradient_downstream = Activation();
  gradient_downstream.header.set_kind(v1::MESSAGE_KIND_GRADIENT);
  EXPECT_EQ(v.CheckFromUpstream(Committed(gradient_downstream)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(v.CheckFromDownstream(Committed(Activation())).code(), absl::StatusCode::kInvalidArgument);
  LinkMessage nan = Activation();
  const float bad = std::numeric_limits<float>::infinity();
  std::memcpy(nan.payload.data() + 12, &bad, 4);
  EXPECT_EQ(v.CheckFromUpstream(Committed(nan)).code(), absl::StatusCode::kInvalidArgument);
  LinkMessage missing_targets = Activation();
  missing_targets.header.mutable_tensors()->RemoveLast();
  EXPECT_EQ(v.CheckFromUpstream(Committed(missing_targets)).code(), absl::StatusCode::kInvalidArgument);
}

// The activation of Activation() with its float32 tensor replaced by
// `frame`, announced as a zstd frame of the raw tensor's 256 bytes.
LinkMessage ZstdActivation(const std::string& frame) {
  LinkMessage m = Activation();
  v1::TensorHeader* t = m.header.mutable_tensors(0);
  const std::string targets = m.payload.substr(t->payload_bytes());
  t->set_zstd(true);
  t->set_encoded_bytes(t->payload_bytes());
  t->set_payload_bytes(frame.size());
  m.payload = frame + targets;
  return m;
}

// Issue 32: compressed frames need a declared size, and the size the
// header announces, before anything decodes them; a refusal here costs the
// sender its link (LinkStream), not the stage its pipeline.
TEST(LinkValidatorTest, AZstdFrameMustDeclareTheAnnouncedSize) {
  LinkValidator v(Job(), 5, 1, 1, 3);
  const std::string raw(256, '\0');
  std::string frame;
  ASSERT_TRUE(ZstdCompress(raw, 1, &frame).ok());
  EXPECT_TRUE(v.CheckFromUpstream(Committed(ZstdActivation(frame))).ok());

  // The same content in a frame that does not say how big it is.
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 0);
  std::string unsized(ZSTD_compressBound(raw.size()), '\0');
  ZSTD_outBuffer out{unsized.data(), unsized.size(), 0};
  ZSTD_inBuffer in{raw.data(), raw.size(), 0};
  ASSERT_EQ(ZSTD_compressStream2(cctx, &out, &in, ZSTD_e_end), 0u);
  ZSTD_freeCCtx(cctx);
  unsized.resize(out.pos);
  absl::Status refused = v.CheckFromUpstream(Committed(ZstdActivation(unsized)));
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("does not declare its size"), std::string::npos) << refused;

  // A small frame that declares 4 GiB: magic, a descriptor with an 8-byte
  // content size and a single segment, the size, one empty last raw block.
  std::string huge("\x28\xb5\x2f\xfd\xe0", 5);
  for (int i = 0; i < 8; ++i) huge.push_back(static_cast<char>((uint64_t{4} << 30) >> (8 * i)));
  huge.append("\x01\x00\x00", 3);
  ASSERT_EQ(ZSTD_getFrameContentSize(huge.data(), huge.size()), uint64_t{4} << 30);
  refused = v.CheckFromUpstream(Committed(ZstdActivation(huge)));
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("declares 4294967296 bytes"), std::string::npos) << refused;

  // Two frames back to back, or trailing bytes, are not one frame.
  refused = v.CheckFromUpstream(Committed(ZstdActivation(frame + "xx")));
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;

  // Gradients too.
  LinkMessage grad;
  grad.header.set_kind(v1::MESSAGE_KIND_GRADIENT);
  grad.header.set_epoch(5);
  AddTensor(&grad, {2, 4, 8}, v1::DTYPE_FLOAT32);
  grad.header.mutable_tensors(0)->set_zstd(true);
  grad.header.mutable_tensors(0)->set_encoded_bytes(256);
  grad.header.mutable_tensors(0)->set_payload_bytes(unsized.size());
  grad.payload = unsized;
  EXPECT_EQ(v.CheckFromDownstream(Committed(grad)).code(), absl::StatusCode::kInvalidArgument);
  grad.header.mutable_tensors(0)->set_payload_bytes(frame.size());
  grad.payload = frame;
  EXPECT_TRUE(v.CheckFromDownstream(Committed(grad)).ok());
}

TEST(LinkValidatorTest, EvaluationAcknowledgementsFlowUpstreamOnlyAndCarryNothing) {
  LinkValidator v(Job(), 5, 1, 1, 3);
  LinkMessage ack;
  ack.header.set_kind(v1::MESSAGE_KIND_EVAL_ACK);
  ack.header.set_epoch(5);
  ack.header.set_step(10);
  EXPECT_TRUE(v.CheckFromDownstream(Committed(ack)).ok());
  EXPECT_EQ(v.CheckFromUpstream(Committed(ack)).code(), absl::StatusCode::kInvalidArgument);
  LinkMessage old_epoch = ack;
  old_epoch.header.set_epoch(4);
  EXPECT_EQ(v.CheckFromDownstream(Committed(old_epoch)).code(), absl::StatusCode::kInvalidArgument);
  LinkMessage with_tensor = ack;
  AddTensor(&with_tensor, {2, 4, 8}, v1::DTYPE_FLOAT32);
  EXPECT_EQ(v.CheckFromDownstream(Committed(with_tensor)).code(), absl::StatusCode::kInvalidArgument);
  LinkMessage with_payload = ack;
  with_payload.payload = "unexpected";
  EXPECT_EQ(v.CheckFromDownstream(Committed(with_payload)).code(), absl::StatusCode::kInvalidArgument);
}

TEST(LinkValidatorTest, StageZeroAcceptsNoLinks) {
  LinkValidator v(Job(), 5, 0, 0, 1);
  EXPECT_EQ(v.CheckHello(Hello(5, -1)).code(), absl::StatusCode::kInvalidArgument);
}

TEST(LinkValidatorTest, RefusesTargetsOutOfRange) {
  LinkValidator v(Job(), 5, 1, 1, 3);
  for (int64_t bad : {int64_t{256}, int64_t{-1}}) {
    LinkMessage m = Activation();
    std::memcpy(&m.payload[m.header.tensors(0).payload_bytes() + 8], &bad, 8);
    EXPECT_EQ(v.CheckFromUpstream(Committed(m)).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(LinkValidatorTest, FirstStageInputIsTokens) {
  LinkValidator v(Job(), 1, 1, 0, 1);  // a stage whose first layer is the embedding
  LinkMessage tokens = Activation({2, 4}, v1::DTYPE_INT64);
  tokens.header.set_epoch(1);
  EXPECT_TRUE(v.CheckFromUpstream(Committed(tokens)).ok());
}

}  // namespace
// Stage 1 of 3 (layers [1, 3)) with raw float32 parameters: what an outer
// message of that stage holds.
OuterMessage OuterDelta(int round = 1) {
  OuterMessage m;
  m.kind = OuterMessage::Kind::kDelta;
  m.epoch = 5;
  m.stage = 1;
  m.round = round;
  m.pipeline = 2;
  m.samples = 64;
  for (int layer = 1; layer < 3; ++layer) {
    v1::LayerWeights& out = m.layers.emplace_back();
    out.set_layer(layer);
    for (const ParameterSpec& param : LayerParameters(Job(), layer)) {
      v1::TensorHeader* t = out.add_params();
      size_t n = 1;
      for (int64_t d : param.shape) {
        t->add_shape(d);
        n *= static_cast<size_t>(d);
      }
      t->set_dtype(v1::DTYPE_FLOAT32);
      t->set_codec(v1::CODEC_NONE);
      t->set_payload_bytes(4 * n);
      std::string bytes(4 * n, '\0');
      for (size_t i = 0; i < n; ++i) {
        const float value = 0.001f * static_cast<float>(i % 7);
        std::memcpy(&bytes[4 * i], &value, 4);
      }
      out.mutable_payload()->append(bytes);
    }
  }
  return m;
}

TEST(LinkValidatorTest, OuterMessagesRoundTripAndFitTheStageExactly) {
  LinkValidator v(Job(), 5, 1, 1, 3, {}, {"w-r2"});
  const OuterMessage delta = OuterDelta();
  LinkMessage wire = ToLinkMessage(delta, 1);
  ASSERT_TRUE(v.CheckFromReplica(wire).ok()) << v.CheckFromReplica(wire);
  absl::StatusOr<OuterMessage> back = FromLinkMessage(wire);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->round, 1);
  EXPECT_EQ(back->pipeline, 2);
  EXPECT_EQ(back->samples, 64);
  ASSERT_EQ(back->layers.size(), delta.layers.size());
  for (size_t i = 0; i < delta.layers.size(); ++i) {
    EXPECT_EQ(back->layers[i].SerializeAsString(), delta.layers[i].SerializeAsString());
  }
  // Only on a replica link: a pipeline neighbour may not send one.
  EXPECT_FALSE(v.CheckFromUpstream(Committed(wire)).ok());
  EXPECT_FALSE(v.CheckFromDownstream(Committed(wire)).ok());
  // Nor an activation on a replica link.
  EXPECT_FALSE(v.CheckFromReplica(Activation()).ok());

  auto refused = [&](const std::function<void(LinkMessage*)>& change, const char* fragment) {
    LinkMessage m = ToLinkMessage(delta, 1);
    change(&m);
    const absl::Status status = v.CheckFromReplica(m);
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << fragment << ": " << status;
    EXPECT_NE(status.message().find(fragment), std::string::npos) << status;
  };
  refused([](LinkMessage* m) { m->header.set_epoch(4); }, "epoch");
  refused([](LinkMessage* m) { m->header.clear_outer(); }, "without its header");
  refused([](LinkMessage* m) { m->header.mutable_outer()->set_round(0); }, "round 0");
  refused([](LinkMessage* m) { m->header.mutable_outer()->mutable_layers()->RemoveLast(); },
          "layers");
  refused([](LinkMessage* m) { m->header.mutable_outer()->mutable_layers(0)->set_layer(2); },
          "where 1 belongs");
  refused([](LinkMessage* m) { m->header.mutable_tensors(0)->set_shape(0, 9); }, "shape");
  refused([](LinkMessage* m) { m->header.mutable_tensors(0)->set_dtype(v1::DTYPE_INT64); },
          "payload");
  refused(
      [](LinkMessage* m) {
        *m->header.add_tensors() = m->header.tensors(0);
        m->payload.append(m->payload.substr(0, m->header.tensors(0).payload_bytes()));
      },
      "tensors");
  refused(
      [](LinkMessage* m) {
        const float nan = std::numeric_limits<float>::quiet_NaN();
        std::memcpy(&m->payload[4], &nan, 4);
      },
      "non-finite");
}

TEST(LinkValidatorTest, AnOuterStateListsTheStageOnceOrTwice) {
  LinkValidator v(Job(), 5, 1, 1, 3, {}, {"w-r0"});
  OuterMessage state = OuterDelta();
  state.kind = OuterMessage::Kind::kState;
  state.round = 0;  // no outer step yet: weights only
  ASSERT_TRUE(v.CheckFromReplica(ToLinkMessage(state, 1)).ok());
  const std::vector<v1::LayerWeights> weights = state.layers;
  state.layers.insert(state.layers.end(), weights.begin(), weights.end());  // and momentum
  state.round = 3;
  ASSERT_TRUE(v.CheckFromReplica(ToLinkMessage(state, 1)).ok());
  state.layers.insert(state.layers.end(), weights.begin(), weights.end());
  EXPECT_FALSE(v.CheckFromReplica(ToLinkMessage(state, 1)).ok());
  // A DELTA lists the stage once, and starts at round 1.
  OuterMessage delta = OuterDelta();
  delta.layers.insert(delta.layers.end(), weights.begin(), weights.end());
  EXPECT_FALSE(v.CheckFromReplica(ToLinkMessage(delta, 1)).ok());
  EXPECT_FALSE(v.CheckFromReplica(ToLinkMessage(OuterDelta(/*round=*/0), 1)).ok());
}

TEST(LinkValidatorTest, ReplicaHellosComeOnlyFromThePlannedReplicas) {
  LinkValidator v(Job(), 5, 1, 1, 3, {"w-up"}, {"w-r1", "w-r2"});
  EXPECT_TRUE(v.CheckHelloFromReplica(MakeHello(5, 1, "w-r1", "w-self"), "w-self").ok());
  EXPECT_FALSE(v.CheckHelloFromReplica(MakeHello(5, 1, "w-stranger", "w-self"), "w-self").ok());
  EXPECT_FALSE(v.CheckHelloFromReplica(MakeHello(5, 1, "w-r1", "w-other"), "w-self").ok());
  EXPECT_FALSE(v.CheckHelloFromReplica(MakeHello(5, 0, "w-r1", "w-self"), "w-self").ok());
  EXPECT_FALSE(v.CheckHelloFromReplica(MakeHello(4, 1, "w-r1", "w-self"), "w-self").ok());
  // A newer epoch: the dialler saw the plan first (it retries).
  EXPECT_TRUE(absl::IsFailedPrecondition(
      v.CheckHelloFromReplica(MakeHello(6, 1, "w-r1", "w-self"), "w-self")));
}

}  // namespace geotrain
