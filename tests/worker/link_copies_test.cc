// The hot path's copy contract (docs/hot_path.md): between a stage's output
// tensor and the socket a message's tensor bytes are copied once (encoding
// into the payload; frames go out as slices of it), and between the socket
// and the next stage's input twice (frames into the payload, the payload
// into the tensor). Counted by PayloadCopies() over real links: a gRPC
// Link stream between two LinkServices, and the framing relayed links use
// over a TCP connection.
#include <torch/torch.h>

#include <cstring>
#include <random>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/commitment.h"
#include "common/link_frame_wire.h"
#include "common/model_profile.h"
#include "common/rpc_options.h"
#include "common/tcp_socket.h"
#include "common/tensor_wire.h"
#include "common/transport_security.h"
#include "gtest/gtest.h"
#include "worker/link_dialer.h"
#include "worker/link_service.h"
#include "worker/link_transport.h"

namespace geotrain {
namespace {

v1::JobSpec Job() {
  v1::JobSpec job;
  job.set_name("copies");
  job.mutable_mlp()->add_hidden(4096);
  job.mutable_mlp()->add_hidden(128);
  job.mutable_fashion_mnist()->set_dir("/nonexistent");
  job.set_microbatch_size(256);  // activations of 256 x 4096 floats: 4 MiB, 5 frames
  job.set_microbatches(1);
  return job;
}

// A stage-0 activation message as the stage runtime builds one.
LinkMessage Activation(const v1::JobSpec& job, uint64_t microbatch, const WireEncoding& encoding,
                       torch::Tensor* values) {
  LinkMessage m;
  m.header.set_kind(v1::MESSAGE_KIND_ACTIVATION);
  m.header.set_epoch(1);
  m.header.set_microbatch(microbatch);
  m.header.set_from_stage(0);
  const TensorSpec spec = LayerInputSpec(job, 1, job.microbatch_size());
  *values = torch::randn(spec.shape);
  EXPECT_TRUE(EncodeTensor(*values, m.header.add_tensors(), &m.payload, encoding).ok());
  EXPECT_TRUE(EncodeTensor(torch::full({job.microbatch_size()}, 3, torch::kInt64),
                           m.header.add_tensors(), &m.payload)
                  .ok());
  m.header.set_commitment(CommitmentOf(m.header, m.payload));
  return m;
}

struct Copies {
  double send, receive, staging;
};

// Per payload byte: copies on the sending side (into the payload, and into
// the wire) and on the receiving side (into the payload, into the tensor).
Copies PerPayloadByte(uint64_t payload_bytes) {
  const PayloadCopyCounters& c = PayloadCopies();
  const double bytes = static_cast<double>(payload_bytes);
  return {(c.tensor_to_payload + c.payload_to_wire) / bytes,
          (c.wire_to_payload + c.payload_to_tensor) / bytes, c.staging / bytes};
}

TEST(FrameBufferTest, DataIsASliceOfThePayloadAndTheBytesAreLinkFramesEncoding) {
  auto message = std::make_shared<LinkMessage>();
  message->header.set_kind(v1::MESSAGE_KIND_ACTIVATION);
  message->header.set_microbatch(7);
  message->payload.assign(3000, 'x');
  for (size_t i = 0; i < message->payload.size(); ++i) message->payload[i] = static_cast<char>(i);
  const std::shared_ptr<const LinkMessage> shared = message;
  const std::vector<v1::LinkFrame> protos = SplitIntoFrames(*message, 1000);
  const std::vector<FrameRange> ranges = FrameRanges(message->payload.size(), 1000);
  ASSERT_EQ(ranges.size(), 3u);
  for (size_t f = 0; f < ranges.size(); ++f) {
    std::vector<grpc::Slice> slices;
    {
      grpc::ByteBuffer buffer = FrameBuffer(OutgoingFrame{shared, ranges[f]});
      ASSERT_TRUE(buffer.Dump(&slices).ok());
    }
    // The data slice points into the payload itself, and holds the message.
    bool found = false;
    std::string wire;
    for (const grpc::Slice& slice : slices) {
      const char* begin = reinterpret_cast<const char*>(slice.begin());
      if (begin == message->payload.data() + ranges[f].offset) {
        found = true;
        EXPECT_EQ(slice.size(), ranges[f].size);
      }
      wire.append(begin, slice.size());
    }
    EXPECT_TRUE(found) << "frame " << f << ": no slice refers to the payload";
    EXPECT_GE(shared.use_count(), 2);
    EXPECT_EQ(wire, protos[f].SerializeAsString()) << "frame " << f;
    slices.clear();
    EXPECT_EQ(shared.use_count(), 2);  // `message` and `shared`: the slice let go
  }
}

TEST(ParseFrameTest, ReadsWhatProtobufReadsAcrossAnySplit) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    v1::LinkFrame frame;
    if (trial % 3 != 0) {
      frame.mutable_header()->set_kind(v1::MESSAGE_KIND_GRADIENT);
      frame.mutable_header()->set_microbatch(rng());
      frame.mutable_header()->add_tensors()->add_shape(trial);
    }
    frame.set_data(std::string(rng() % 3000, static_cast<char>(trial)));
    frame.set_last(trial % 2 == 0);
    const std::string wire = frame.SerializeAsString();
    std::vector<absl::string_view> pieces;
    for (size_t at = 0; at < wire.size();) {
      const size_t n = std::min<size_t>(wire.size() - at, 1 + rng() % 700);
      pieces.push_back(absl::string_view(wire).substr(at, n));
      at += n;
    }
    absl::StatusOr<FrameParts> parts = ParseFrame(pieces);
    ASSERT_TRUE(parts.ok()) << parts.status();
    std::string data;
    for (absl::string_view v : parts->data) data.append(v.data(), v.size());
    EXPECT_EQ(data, frame.data());
    EXPECT_EQ(parts->data_bytes, frame.data().size());
    EXPECT_EQ(parts->last, frame.last());
    ASSERT_EQ(parts->header.has_value(), frame.has_header());
    if (frame.has_header()) EXPECT_EQ(parts->header->microbatch(), frame.header().microbatch());
  }
}

TEST(ParseFrameTest, RefusesWhatProtobufRefuses) {
  const std::string cases[] = {
      std::string("\x12\x05" "abc", 5),      // data runs past the end
      std::string("\x0a\x02\xff\xff", 4),    // a header that does not parse
      std::string("\x13", 1),                // a group
      std::string("\x00\x01", 2),            // field 0
      std::string("\x18\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 12),  // an 11-byte varint
  };
  for (const std::string& bad : cases) {
    v1::LinkFrame proto;
    EXPECT_FALSE(proto.ParseFromString(bad));
    const absl::string_view piece(bad);
    EXPECT_FALSE(ParseFrame({&piece, 1}).ok()) << absl::CEscape(bad);
  }
  // Unknown fields are skipped, as protobuf does.
  const std::string unknown("\x20\x05\x2d\x01\x02\x03\x04\x18\x01", 9);
  const absl::string_view piece(unknown);
  absl::StatusOr<FrameParts> parts = ParseFrame({&piece, 1});
  ASSERT_TRUE(parts.ok()) << parts.status();
  EXPECT_TRUE(parts->last);
}

class GrpcLinkCopiesTest : public ::testing::TestWithParam<v1::Codec> {};

TEST_P(GrpcLinkCopiesTest, OneCopyOutAndTwoInPerMessage) {
  const v1::JobSpec job = Job();
  LinkOptions options;
  options.transport.insecure = true;
  auto receiver_validator = std::make_shared<const LinkValidator>(
      job, 1, 1, 1, NumLayers(job), std::set<std::string>{"w0"});
  auto inbox = std::make_shared<Inbox>(64);
  LinkService receiver(options);
  receiver.SetWorkerId("w1");
  receiver.Activate(receiver_validator, inbox, {});
  grpc::ServerBuilder builder;
  ConfigureServerBuilder(&builder);
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&receiver);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);

  auto sender_validator = std::make_shared<const LinkValidator>(job, 1, 0, 0, 1);
  LinkService sender(options);
  std::atomic<bool> stop{false};
  DialTarget target{"w0", 0,
                    {"w1", absl::StrCat("127.0.0.1:", port), PeerSide::kDownstream}, nullptr};
  absl::StatusOr<std::shared_ptr<LinkEnd>> end =
      OpenLink(target, sender_validator, std::make_shared<Inbox>(4), options, &sender, &stop);
  ASSERT_TRUE(end.ok()) << end.status();

  WireEncoding encoding;
  encoding.codec = GetParam();
  constexpr int kMessages = 8;
  PayloadCopies().Reset();
  uint64_t payload_bytes = 0;
  std::vector<torch::Tensor> sent(kMessages);
  std::thread sending([&] {
    for (int i = 0; i < kMessages; ++i) {
      LinkMessage m = Activation(job, i, encoding, &sent[i]);
      EXPECT_TRUE((*end)->Send(std::move(m)).ok());
    }
  });
  sending.join();  // the inbox holds all of them
  for (int received = 0; received < kMessages;) {
    std::optional<InboundMessage> in = inbox->Pop(absl::Seconds(60));
    ASSERT_TRUE(in.has_value());
    ASSERT_TRUE(in->error.ok()) << in->error;
    if (in->message.header.kind() != v1::MESSAGE_KIND_ACTIVATION) continue;
    payload_bytes += in->message.payload.size();
    absl::StatusOr<torch::Tensor> values =
        DecodeTensor(in->message.header.tensors(0), in->message.payload, 0);
    ASSERT_TRUE(values.ok()) << values.status();
    absl::StatusOr<torch::Tensor> labels =
        DecodeTensor(in->message.header.tensors(1), in->message.payload,
                     in->message.header.tensors(0).payload_bytes());
    ASSERT_TRUE(labels.ok()) << labels.status();
    if (GetParam() == v1::CODEC_NONE) {
      EXPECT_TRUE(torch::equal(*values, sent[in->message.header.microbatch()]));
    } else {
      EXPECT_LT((*values - sent[in->message.header.microbatch()]).abs().max().item<float>(), 0.1);
    }
    ++received;
  }
  const Copies copies = PerPayloadByte(payload_bytes);
  std::printf("%s over gRPC: %.3f copies of each payload byte sending, %.3f receiving, %.3f "
              "through scratch buffers (%lu payload bytes in %d messages)\n",
              v1::Codec_Name(GetParam()).c_str(), copies.send, copies.receive, copies.staging,
              static_cast<unsigned long>(payload_bytes), kMessages);
  EXPECT_DOUBLE_EQ(copies.send, 1.0);
  EXPECT_DOUBLE_EQ(copies.receive, 2.0);
  EXPECT_EQ(PayloadCopies().payload_to_wire, 0u);
  EXPECT_EQ(copies.staging, 0.0);
  (void)(*end)->Close(absl::Seconds(10));
  receiver.Shutdown();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

INSTANTIATE_TEST_SUITE_P(Codecs, GrpcLinkCopiesTest,
                         ::testing::Values(v1::CODEC_NONE, v1::CODEC_INT8),
                         [](const auto& info) { return v1::Codec_Name(info.param); });

TEST(RelayedLinkCopiesTest, TheFramingOverTcpCopiesNothingMore) {
  absl::StatusOr<TcpListener> listener = TcpListener::Listen("127.0.0.1:0");
  ASSERT_TRUE(listener.ok()) << listener.status();
  absl::StatusOr<TcpSocket> accepted;
  std::thread accepting([&] { accepted = listener->Accept(); });
  absl::StatusOr<TcpSocket> dialled =
      TcpSocket::Connect(absl::StrCat("127.0.0.1:", listener->port()), absl::Seconds(5));
  accepting.join();
  ASSERT_TRUE(dialled.ok() && accepted.ok());
  std::unique_ptr<LinkTransport> out = MakeRelayedTransport(*std::move(dialled), "out");
  std::unique_ptr<LinkTransport> in = MakeRelayedTransport(*std::move(accepted), "in");

  const v1::JobSpec job = Job();
  PayloadCopies().Reset();
  torch::Tensor values;
  auto message = std::make_shared<const LinkMessage>(Activation(job, 3, WireEncoding(), &values));
  std::thread writing([&] {
    for (const FrameRange& range : FrameRanges(message->payload.size())) {
      EXPECT_TRUE(out->Write(OutgoingFrame{message, range}));
    }
  });
  FrameAssembler assembler;
  std::optional<LinkMessage> received;
  IncomingFrame frame;
  while (!received.has_value()) {
    ASSERT_TRUE(in->Read(&frame));
    absl::StatusOr<FrameParts> parts = ParseFrame(frame.pieces);
    ASSERT_TRUE(parts.ok()) << parts.status();
    absl::StatusOr<std::optional<LinkMessage>> added = assembler.Add(*std::move(parts));
    ASSERT_TRUE(added.ok()) << added.status();
    received = std::move(*added);
  }
  writing.join();
  absl::StatusOr<torch::Tensor> decoded =
      DecodeTensor(received->header.tensors(0), received->payload, 0);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_TRUE(torch::equal(*decoded, values));
  const uint64_t activation_bytes = received->header.tensors(0).payload_bytes();
  const PayloadCopyCounters& c = PayloadCopies();
  // The labels tensor is encoded but not decoded here.
  EXPECT_EQ(c.tensor_to_payload, received->payload.size());
  EXPECT_EQ(c.payload_to_wire, 0u);
  EXPECT_EQ(c.wire_to_payload, received->payload.size());
  EXPECT_EQ(c.payload_to_tensor, activation_bytes);
  EXPECT_EQ(c.staging, 0u);
}

}  // namespace
}  // namespace geotrain
