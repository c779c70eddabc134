// Commitments: what a worker binds itself to when it sends an activation or
// a gradient (docs/verification.md). A commitment is the SHA-256 of the
// message's identity (kind, plan epoch, microbatch, step, weight versions,
// sending stage, every tensor's header) and its encoded payload, in a fixed
// layout of this file's own, so any build of geotrain computes the same
// bytes for the same message whatever its protobuf library:
//
//   SHA-256("geotrain.link-commitment.v3" || u64 len(identity) ||
//           u64 len(payload) || identity || payload)
//   identity = kind, epoch, microbatch, step, weight_version, from_stage,
//              count of weight_versions, each; count of tensors, and per
//              tensor: count of dims, each dim, dtype, codec,
//              payload_bytes, block_size, zstd (0/1), encoded_bytes;
//              len(weights_digest), weights_digest,
//              len(state_digest), state_digest, weight_syncs
//
// every number a 64-bit little-endian integer (enums by their value), the
// digest its bytes.
//
// The sender puts it in LinkHeader.commitment; the receiver recomputes it
// and refuses a message whose commitment does not match, then logs it with
// the sender's authenticated identity. A worker cannot later deny what it
// sent: the receiver's log and the link's mTLS identity are the evidence,
// and the sender's own log of the bytes lets a verifier recompute the step.
// Torch-free.
#ifndef GEOTRAIN_COMMON_COMMITMENT_H_
#define GEOTRAIN_COMMON_COMMITMENT_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "geotrain/v1/stage.pb.h"

namespace geotrain {

// Bytes of a commitment (SHA-256).
inline constexpr size_t kCommitmentBytes = 32;

// Whether messages of `kind` carry a commitment: the training traffic
// (ACTIVATION, GRADIENT), whose numbers a spot check may recompute.
bool IsCommittedKind(v1::MessageKind kind);

// The commitment of a message with `header` and `payload`. Ignores what
// is not the message's content: the commitment field itself, the receive
// rate, the HELLO's worker ids and the outer header.
std::string CommitmentOf(const v1::LinkHeader& header, absl::string_view payload);

// OK when `header.commitment` is `payload`'s (for a kind that carries one;
// any other kind must carry none). INVALID_ARGUMENT otherwise, saying
// which.
absl::Status CheckCommitment(const v1::LinkHeader& header, absl::string_view payload);

// Lower-case hex of a commitment (logs, events, status).
std::string CommitmentHex(absl::string_view commitment);

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_COMMITMENT_H_
