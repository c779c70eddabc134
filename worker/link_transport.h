// What a link end reads LinkFrames from and writes them to, whichever end
// dialled and however the bytes travel:
// - a gRPC Link stream this worker dialled (GrpcClientTransport), or one a
//   peer dialled (GrpcServerTransport, inside the Stage service's handler);
// - a TCP connection spliced by a geotrain-relay (RelayedTransport): TLS 1.3
//   end to end between the two workers (plaintext when insecure), frames as
//   a 4-byte big-endian length and the serialized LinkFrame.
//
// Either way a frame's tensor bytes are not copied in user space: a frame
// goes out as its encoding's prefix, then the data straight from the
// message's payload (gRPC: a slice that refers to it), then its suffix
// (link_frame_wire.h); one comes in as the buffers it was read into, which
// the FrameAssembler copies once into the message. The gRPC stream carries
// raw bytes (ByteBuffer) with LinkFrame's encoding, so a peer that uses the
// generated LinkFrame stub sees the same messages.
//
// Thread-safety: one thread reads and one writes at a time; Cancel() is
// safe from any thread and makes blocked calls return false.
#ifndef GEOTRAIN_WORKER_LINK_TRANSPORT_H_
#define GEOTRAIN_WORKER_LINK_TRANSPORT_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/link_message.h"
#include "common/tcp_socket.h"
#include "common/tls_session.h"
#include "geotrain/v1/stage.grpc.pb.h"

namespace geotrain {

// A relayed frame larger than this ends the link before it is buffered.
inline constexpr uint32_t kMaxRelayedFrameBytes = 4 << 20;

// One frame on its way out: a range of a message's payload (the header
// goes with the range at offset 0). Shared because gRPC may go on reading
// the payload after Write() returns, until the bytes are on the socket.
struct OutgoingFrame {
  std::shared_ptr<const LinkMessage> message;
  FrameRange range;
};

// One frame as read: its encoding (ParseFrame) in `pieces`, which point
// into `slices` (gRPC) or `buffer` (relayed). Valid until the next Read().
struct IncomingFrame {
  std::vector<absl::string_view> pieces;
  std::vector<grpc::Slice> slices;
  std::string buffer;
};

// The encoding of `frame` as gRPC slices: its data is a slice over the
// payload that holds a reference to the message (no copy).
grpc::ByteBuffer FrameBuffer(const OutgoingFrame& frame);

class LinkTransport {
 public:
  virtual ~LinkTransport() = default;
  virtual bool Read(IncomingFrame* frame) = 0;
  virtual bool Write(const OutgoingFrame& frame) = 0;
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

// The Stage service's Link method, for raw streams on either side.
inline constexpr char kLinkMethod[] = "/geotrain.v1.Stage/Link";
using RawLinkStream = grpc::ServerReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>;

// Opens a Link stream on `channel` and owns the call.
std::unique_ptr<LinkTransport> MakeGrpcClientTransport(
    std::shared_ptr<grpc::Channel> channel, std::unique_ptr<grpc::ClientContext> context,
    std::string description);

// Borrows the handler's stream and context: valid until the handler returns.
std::unique_ptr<LinkTransport> MakeGrpcServerTransport(grpc::ServerContext* context,
                                                       RawLinkStream* stream,
                                                       std::string description);

// Over a connection a relay spliced: `tls` (secure) or `plain` (insecure).
std::unique_ptr<LinkTransport> MakeRelayedTransport(std::unique_ptr<TlsSession> tls,
                                                    std::string description);
std::unique_ptr<LinkTransport> MakeRelayedTransport(TcpSocket plain, std::string description);

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_LINK_TRANSPORT_H_
