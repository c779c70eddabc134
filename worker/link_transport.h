// What a link end reads LinkFrames from and writes them to, whichever end
// dialled and however the bytes travel:
// - a gRPC Link stream this worker dialled (GrpcClientTransport), or one a
//   peer dialled (GrpcServerTransport, inside the Stage service's handler);
// - a TCP connection spliced by a geotrain-relay (RelayedTransport): TLS 1.3
//   end to end between the two workers (plaintext when insecure), frames as
//   a 4-byte big-endian length and the serialized LinkFrame.
//
// Thread-safety: one thread reads and one writes at a time; Cancel() is
// safe from any thread and makes blocked calls return false.
#ifndef GEOTRAIN_WORKER_LINK_TRANSPORT_H_
#define GEOTRAIN_WORKER_LINK_TRANSPORT_H_

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tcp_socket.h"
#include "common/tls_session.h"
#include "geotrain/v1/stage.grpc.pb.h"

namespace geotrain {

// A relayed frame larger than this ends the link before it is buffered.
inline constexpr uint32_t kMaxRelayedFrameBytes = 4 << 20;

class LinkTransport {
 public:
  virtual ~LinkTransport() = default;
  virtual bool Read(v1::LinkFrame* frame) = 0;
  virtual bool Write(const v1::LinkFrame& frame) = 0;
  virtual void Cancel() = 0;
  // Ends this side's writes, so the peer reads the end of the stream. No-op
  // for the answering end of a gRPC stream: that ends when its handler
  // returns.
  virtual void CloseWrites() = 0;
  // After Read() returned false: OK when the peer ended the stream cleanly
  // (half-closed, or its handler returned OK); why not otherwise.
  virtual absl::Status Finish() = 0;
  // The answering end of a gRPC stream: the stream ends (with the status
  // the handler returns) when its reader returns, so a refused message must
  // not cancel it (the peer would see CANCELLED instead of the reason).
  virtual bool ends_when_served() const { return false; }
  // E.g. "direct to 198.51.100.3:7001" or "via relay w4 at 198.51.100.9:7400".
  virtual std::string description() const = 0;
};

// Owns the call. `stub` and `context` must outlive nothing else.
std::unique_ptr<LinkTransport> MakeGrpcClientTransport(
    std::unique_ptr<v1::Stage::Stub> stub, std::unique_ptr<grpc::ClientContext> context,
    std::unique_ptr<grpc::ClientReaderWriter<v1::LinkFrame, v1::LinkFrame>> stream,
    std::string description);

// Borrows the handler's stream and context: valid until the handler returns.
std::unique_ptr<LinkTransport> MakeGrpcServerTransport(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* stream, std::string description);

// Over a connection a relay spliced: `tls` (secure) or `plain` (insecure).
std::unique_ptr<LinkTransport> MakeRelayedTransport(std::unique_ptr<TlsSession> tls,
                                                    std::string description);
std::unique_ptr<LinkTransport> MakeRelayedTransport(TcpSocket plain, std::string description);

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_LINK_TRANSPORT_H_
