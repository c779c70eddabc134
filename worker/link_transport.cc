#include "worker/link_transport.h"

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"

namespace geotrain {
namespace {

class GrpcClientTransport final : public LinkTransport {
 public:
  GrpcClientTransport(std::unique_ptr<v1::Stage::Stub> stub,
                      std::unique_ptr<grpc::ClientContext> context,
                      std::unique_ptr<grpc::ClientReaderWriter<v1::LinkFrame, v1::LinkFrame>> stream,
                      std::string description)
      : stub_(std::move(stub)),
        context_(std::move(context)),
        stream_(std::move(stream)),
        description_(std::move(description)) {}
  ~GrpcClientTransport() override {
    if (!finished_) {
      context_->TryCancel();
      stream_->Finish();
    }
  }
  bool Read(v1::LinkFrame* frame) override { return stream_->Read(frame); }
  bool Write(const v1::LinkFrame& frame) override { return stream_->Write(frame); }
  void Cancel() override { context_->TryCancel(); }
  void CloseWrites() override { stream_->WritesDone(); }
  absl::Status Finish() override {
    finished_ = true;
    return FromGrpcStatus(stream_->Finish());
  }
  std::string description() const override { return description_; }

 private:
  std::unique_ptr<v1::Stage::Stub> stub_;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::LinkFrame, v1::LinkFrame>> stream_;
  const std::string description_;
  bool finished_ = false;
};

class GrpcServerTransport final : public LinkTransport {
 public:
  GrpcServerTransport(grpc::ServerContext* context,
                      grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* stream,
                      std::string description)
      : context_(context), stream_(stream), description_(std::move(description)) {}
  bool Read(v1::LinkFrame* frame) override { return stream_->Read(frame); }
  bool Write(const v1::LinkFrame& frame) override { return stream_->Write(frame); }
  void Cancel() override { context_->TryCancel(); }
  void CloseWrites() override {}
  absl::Status Finish() override {
    return context_->IsCancelled() ? absl::CancelledError("link cancelled") : absl::OkStatus();
  }
  bool ends_when_served() const override { return true; }
  std::string description() const override { return description_; }

 private:
  grpc::ServerContext* const context_;
  grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* const stream_;
  const std::string description_;
};

// Length-prefixed LinkFrames over a byte stream (TLS or plain TCP).
template <typename Channel>
class FramedTransport final : public LinkTransport {
 public:
  FramedTransport(Channel channel, std::string description)
      : channel_(std::move(channel)), description_(std::move(description)) {}
  bool Read(v1::LinkFrame* frame) override {
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
    buffer_.resize(size);
    if (!ReadExactly(buffer_.data(), size)) {
      end_ = absl::UnavailableError(absl::StrCat(description_, ": broke inside a frame"));
      return false;
    }
    if (!frame->ParseFromString(buffer_)) {
      end_ = absl::InvalidArgumentError("relayed frame does not parse as a LinkFrame");
      return false;
    }
    return true;
  }
  bool Write(const v1::LinkFrame& frame) override {
    std::string bytes;
    frame.SerializeToString(&bytes);
    const uint32_t size = static_cast<uint32_t>(bytes.size());
    unsigned char prefix[4] = {static_cast<unsigned char>(size >> 24),
                               static_cast<unsigned char>(size >> 16),
                               static_cast<unsigned char>(size >> 8),
                               static_cast<unsigned char>(size)};
    return size > 0 && WriteAll(prefix, 4) && WriteAll(bytes.data(), bytes.size());
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
  std::string buffer_;
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

std::unique_ptr<LinkTransport> MakeGrpcClientTransport(
    std::unique_ptr<v1::Stage::Stub> stub, std::unique_ptr<grpc::ClientContext> context,
    std::unique_ptr<grpc::ClientReaderWriter<v1::LinkFrame, v1::LinkFrame>> stream,
    std::string description) {
  return std::make_unique<GrpcClientTransport>(std::move(stub), std::move(context),
                                               std::move(stream), std::move(description));
}

std::unique_ptr<LinkTransport> MakeGrpcServerTransport(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* stream, std::string description) {
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
