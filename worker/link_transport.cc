#include "worker/link_transport.h"

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "common/link_frame_wire.h"

namespace geotrain {
namespace {

void ReleaseMessage(void* owner) { delete static_cast<std::shared_ptr<const LinkMessage>*>(owner); }

// A gRPC message's slices as the frame's pieces (no copy).
bool DumpInto(const grpc::ByteBuffer& buffer, IncomingFrame* frame) {
  frame->pieces.clear();
  frame->slices.clear();
  if (!buffer.Dump(&frame->slices).ok()) return false;
  for (const grpc::Slice& slice : frame->slices) {
    frame->pieces.emplace_back(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return true;
}

class GrpcClientTransport final : public LinkTransport {
 public:
  GrpcClientTransport(std::shared_ptr<grpc::Channel> channel,
                      std::unique_ptr<grpc::ClientContext> context, std::string description)
      : channel_(std::move(channel)),
        context_(std::move(context)),
        // What the generated stub does, with ByteBuffer for LinkFrame.
        stream_(grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::
                    Create(channel_.get(),
                           grpc::internal::RpcMethod(kLinkMethod,
                                                     grpc::internal::RpcMethod::BIDI_STREAMING),
                           context_.get())),
        description_(std::move(description)) {}
  ~GrpcClientTransport() override {
    if (!finished_) {
      context_->TryCancel();
      stream_->Finish();
    }
  }
  bool Read(IncomingFrame* frame) override {
    grpc::ByteBuffer buffer;
    return stream_->Read(&buffer) && DumpInto(buffer, frame);
  }
  bool Write(const OutgoingFrame& frame) override { return stream_->Write(FrameBuffer(frame)); }
  void Cancel() override { context_->TryCancel(); }
  void CloseWrites() override { stream_->WritesDone(); }
  absl::Status Finish() override {
    finished_ = true;
    return FromGrpcStatus(stream_->Finish());
  }
  std::string description() const override { return description_; }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream_;
  const std::string description_;
  bool finished_ = false;
};

class GrpcServerTransport final : public LinkTransport {
 public:
  GrpcServerTransport(grpc::ServerContext* context, RawLinkStream* stream,
                      std::string description)
      : context_(context), stream_(stream), description_(std::move(description)) {}
  bool Read(IncomingFrame* frame) override {
    grpc::ByteBuffer buffer;
    return stream_->Read(&buffer) && DumpInto(buffer, frame);
  }
  bool Write(const OutgoingFrame& frame) override { return stream_->Write(FrameBuffer(frame)); }
  void Cancel() override { context_->TryCancel(); }
  void CloseWrites() override {}
  absl::Status Finish() override {
    return context_->IsCancelled() ? absl::CancelledError("link cancelled") : absl::OkStatus();
  }
  bool ends_when_served() const override { return true; }
  std::string description() const override { return description_; }

 private:
  grpc::ServerContext* const context_;
  RawLinkStream* const stream_;
  const std::string description_;
};

// Length-prefixed LinkFrames over a byte stream (TLS or plain TCP).
template <typename Channel>
class FramedTransport final : public LinkTransport {
 public:
  FramedTransport(Channel channel, std::string description)
      : channel_(std::move(channel)), description_(std::move(description)) {}
  bool Read(IncomingFrame* frame) override {
    unsigned char prefix[4];
    if (!ReadExactly(prefix, sizeof(prefix))) {
      end_ = cancelled_ ? absl::CancelledError("link cancelled")
                        : absl::UnavailableError(absl::StrCat(description_, ": stream ended"));
      return false;
    }
    const uint32_t size = (uint32_t{prefix[0]} << 24) | (uint32_t{prefix[1]} << 16) |
                          (uint32_t{prefix[2]} << 8) | prefix[3];
    if (size == 0) {  // our end-of-stream marker: a clean close
      end_ = absl::OkStatus();
      return false;
    }
    if (size > kMaxRelayedFrameBytes) {
      end_ = absl::InvalidArgumentError(absl::StrCat(
          "relayed frame of ", size, " bytes: at most ", kMaxRelayedFrameBytes));
      return false;
    }
    frame->buffer.resize(size);
    if (!ReadExactly(frame->buffer.data(), size)) {
      end_ = absl::UnavailableError(absl::StrCat(description_, ": broke inside a frame"));
      return false;
    }
    frame->slices.clear();
    frame->pieces.assign(1, frame->buffer);
    return true;
  }
  // The length and the encoding's prefix in one write, then the data from
  // the payload itself, then the suffix.
  bool Write(const OutgoingFrame& frame) override {
    const LinkMessage& message = *frame.message;
    const std::string prefix =
        FramePrefix(frame.range.offset == 0 ? &message.header : nullptr, frame.range.size);
    const absl::string_view suffix = FrameSuffix(frame.range.last);
    const uint64_t size = prefix.size() + frame.range.size + suffix.size();
    if (size == 0 || size > kMaxRelayedFrameBytes) return false;
    std::string head(4, '\0');
    for (int i = 0; i < 4; ++i) head[i] = static_cast<char>(size >> (24 - 8 * i));
    head += prefix;
    return WriteAll(head.data(), head.size()) &&
           WriteAll(message.payload.data() + frame.range.offset, frame.range.size) &&
           WriteAll(suffix.data(), suffix.size());
  }
  void Cancel() override {
    cancelled_ = true;
    channel_->Shutdown();
  }
  // The zero-length frame is the end of this direction; the peer ends the
  // connection once it has sent its own.
  void CloseWrites() override {
    const unsigned char end[4] = {0, 0, 0, 0};
    WriteAll(end, 4);
    channel_->CloseWrites();
  }
  absl::Status Finish() override { return end_; }
  std::string description() const override { return description_; }

 private:
  bool ReadExactly(void* data, size_t size) { return channel_->ReadExactly(data, size); }
  bool WriteAll(const void* data, size_t size) { return channel_->WriteAll(data, size); }

  Channel channel_;
  const std::string description_;
  std::atomic<bool> cancelled_{false};
  absl::Status end_;
};

// TcpSocket with TlsSession's names, for FramedTransport.
class PlainChannel {
 public:
  explicit PlainChannel(TcpSocket socket) : socket_(std::move(socket)) {}
  bool ReadExactly(void* data, size_t size) { return socket_.ReadExactly(data, size); }
  bool WriteAll(const void* data, size_t size) { return socket_.WriteAll(data, size); }
  void Shutdown() { socket_.Shutdown(); }
  void CloseWrites() {}  // the framing's end marker ends this direction

 private:
  TcpSocket socket_;
};

}  // namespace

grpc::ByteBuffer FrameBuffer(const OutgoingFrame& frame) {
  const LinkMessage& message = *frame.message;
  grpc::Slice slices[3];
  size_t count = 0;
  slices[count++] =
      grpc::Slice(FramePrefix(frame.range.offset == 0 ? &message.header : nullptr, frame.range.size));
  if (frame.range.size > 0) {
    // gRPC only reads the slice; it is released (and with it the message)
    // once the bytes are written or the call ends.
    char* data = const_cast<char*>(message.payload.data()) + frame.range.offset;
    slices[count++] = grpc::Slice(data, frame.range.size, &ReleaseMessage,
                                  new std::shared_ptr<const LinkMessage>(frame.message));
  }
  const absl::string_view suffix = FrameSuffix(frame.range.last);
  if (!suffix.empty()) {
    slices[count++] = grpc::Slice(suffix.data(), suffix.size(), grpc::Slice::STATIC_SLICE);
  }
  return grpc::ByteBuffer(slices, count);
}

std::unique_ptr<LinkTransport> MakeGrpcClientTransport(
    std::shared_ptr<grpc::Channel> channel, std::unique_ptr<grpc::ClientContext> context,
    std::string description) {
  return std::make_unique<GrpcClientTransport>(std::move(channel), std::move(context),
                                               std::move(description));
}

std::unique_ptr<LinkTransport> MakeGrpcServerTransport(grpc::ServerContext* context,
                                                       RawLinkStream* stream,
                                                       std::string description) {
  return std::make_unique<GrpcServerTransport>(context, stream, std::move(description));
}

std::unique_ptr<LinkTransport> MakeRelayedTransport(std::unique_ptr<TlsSession> tls,
                                                    std::string description) {
  return std::make_unique<FramedTransport<std::unique_ptr<TlsSession>>>(std::move(tls),
                                                                        std::move(description));
}

std::unique_ptr<LinkTransport> MakeRelayedTransport(TcpSocket plain, std::string description) {
  return std::make_unique<FramedTransport<std::unique_ptr<PlainChannel>>>(
      std::make_unique<PlainChannel>(std::move(plain)), std::move(description));
}

}  // namespace geotrain
