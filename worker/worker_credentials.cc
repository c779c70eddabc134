#include "worker/worker_credentials.h"

#include <filesystem>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/files.h"
#include "common/grpc_status.h"
#include "common/join_token.h"
#include "common/logging.h"
#include "common/rpc_options.h"
#include "common/status_macros.h"
#include "common/x509.h"
#include "geotrain/v1/coordinator.grpc.pb.h"

namespace geotrain {
namespace {

constexpr char kCredentialFile[] = "worker.credential";
constexpr char kCoordinatorCaFile[] = "coordinator-ca.crt";

// The credential in `dir`, or nullopt when there is none (or it expired).
absl::StatusOr<std::optional<WorkerCredentials>> LoadSaved(const std::string& dir) {
  const std::string credential_path = absl::StrCat(dir, "/", kCredentialFile);
  const std::string ca_path = absl::StrCat(dir, "/", kCoordinatorCaFile);
  if (dir.empty() || !std::filesystem::exists(credential_path)) {
    return std::optional<WorkerCredentials>();
  }
  absl::StatusOr<TransportSecurity> peers = LoadCredentialFile(credential_path);
  if (!peers.ok()) return peers.status();
  absl::StatusOr<std::string> coordinator_ca = ReadFileBounded(ca_path, 1 << 20);
  if (!coordinator_ca.ok()) return coordinator_ca.status();
  absl::StatusOr<absl::Time> expiry = CertificateNotAfter(peers->certificate_pem);
  if (!expiry.ok()) return expiry.status();
  if (*expiry < absl::Now() + absl::Minutes(10)) {
    GT_LOG(Warning) << credential_path << " has expired: enrolling again";
    return std::optional<WorkerCredentials>();
  }
  absl::StatusOr<std::string> id = CertificateCommonName(peers->certificate_pem);
  if (!id.ok()) return id.status();
  WorkerCredentials credentials;
  credentials.worker_id = *id;
  credentials.peers = *peers;
  credentials.coordinator = *peers;
  credentials.coordinator.trusted_ca_pem = *coordinator_ca;
  return std::optional<WorkerCredentials>(std::move(credentials));
}

absl::Status Save(const std::string& dir, const WorkerCredentials& credentials) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) return absl::UnavailableError(absl::StrCat(dir, ": ", error.message()));
  RETURN_IF_ERROR(WriteFileAtomically(
      absl::StrCat(dir, "/", kCredentialFile),
      FormatCredentialFile(absl::StrCat("geotrain worker credential of ", credentials.worker_id),
                           credentials.peers),
      0600));
  return WriteFileAtomically(absl::StrCat(dir, "/", kCoordinatorCaFile),
                             credentials.coordinator.trusted_ca_pem);
}

bool Retryable(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded ||
         code == absl::StatusCode::kResourceExhausted;
}

// One enrollment attempt.
absl::StatusOr<WorkerCredentials> Enroll(const WorkerCredentialOptions& options,
                                         const JoinToken& token) {
  ASSIGN_OR_RETURN(std::string coordinator_ca,
                   PinCertificateAuthority(options.coordinator, token.ca_fingerprint,
                                           options.rpc_timeout));
  ASSIGN_OR_RETURN(std::string key, GeneratePrivateKeyPem());
  ASSIGN_OR_RETURN(std::string csr, CreateCsrPem(key, "geotrain worker"));
  TransportSecurity anonymous;
  anonymous.insecure = false;
  anonymous.trusted_ca_pem = coordinator_ca;
  auto stub = v1::Coordinator::NewStub(
      MakeSecureChannel(options.coordinator, anonymous, options.coordinator_server_name));
  v1::EnrollRequest request;
  request.set_token(options.token);
  request.set_csr_pem(csr);
  request.set_name(options.name);
  v1::EnrollResponse response;
  grpc::ClientContext context;
  context.set_deadline(DeadlineFromNow(absl::ToChronoMilliseconds(options.rpc_timeout)));
  const grpc::Status status = stub->Enroll(&context, request, &response);
  if (!status.ok()) {
    return absl::Status(FromGrpcStatus(status).code(),
                        absl::StrCat("the coordinator at ", options.coordinator,
                                     " refused the token: ", status.error_message()));
  }
  WorkerCredentials credentials;
  credentials.worker_id = response.worker_id();
  credentials.peers.insecure = false;
  credentials.peers.certificate_pem = response.certificate_pem();
  credentials.peers.private_key_pem = key;
  credentials.peers.trusted_ca_pem = response.ca_pem();
  RETURN_IF_ERROR(CheckKeyMatches(response.certificate_pem(), key));
  RETURN_IF_ERROR(VerifyIssuedBy(response.certificate_pem(), response.ca_pem()));
  credentials.coordinator = credentials.peers;
  credentials.coordinator.trusted_ca_pem = coordinator_ca;
  credentials.enrolled_now = true;
  return credentials;
}

}  // namespace

absl::StatusOr<WorkerCredentials> ObtainWorkerCredentials(const WorkerCredentialOptions& options,
                                                          const std::atomic<bool>& stop,
                                                          absl::Duration give_up_after) {
  std::optional<JoinToken> token;
  if (!options.token.empty()) {
    absl::StatusOr<JoinToken> parsed = ParseJoinToken(options.token);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--token: ", parsed.status().message()));
    }
    token = *parsed;
  }
  ASSIGN_OR_RETURN(std::optional<WorkerCredentials> saved, LoadSaved(options.state_dir));
  if (saved.has_value()) {
    absl::StatusOr<std::string> saved_ca = CertificateFingerprint(saved->coordinator.trusted_ca_pem);
    // A token for another coordinator's CA means a move: enroll there.
    if (!token.has_value() || (saved_ca.ok() && *saved_ca == token->ca_fingerprint)) {
      GT_LOG(Info) << "rejoining as " << saved->worker_id << " (credential in "
                   << options.state_dir << ")";
      return *std::move(saved);
    }
  }
  if (!token.has_value()) {
    return absl::UnauthenticatedError(
        "no credential: pass --token=TOKEN (from `geotrain-ctl token create` on the "
        "coordinator's host), or --insecure for a coordinator started with --insecure");
  }
  const absl::Time give_up = absl::Now() + give_up_after;
  absl::Duration backoff = absl::Milliseconds(500);
  while (!stop) {
    absl::StatusOr<WorkerCredentials> enrolled = Enroll(options, *token);
    if (enrolled.ok()) {
      GT_LOG(Info) << "enrolled with token " << token->id << " as " << enrolled->worker_id;
      if (!options.state_dir.empty()) RETURN_IF_ERROR(Save(options.state_dir, *enrolled));
      return enrolled;
    }
    if (!Retryable(enrolled.status().code()) || absl::Now() + backoff > give_up) {
      return enrolled.status();
    }
    const absl::Duration wait = Jittered(backoff);
    GT_LOG(Warning) << enrolled.status().message() << "; retrying in "
                    << absl::FormatDuration(absl::Trunc(wait, absl::Milliseconds(1)));
    absl::SleepFor(wait);
    backoff = std::min(backoff * 2, absl::Seconds(10));
  }
  return absl::CancelledError("stopped before enrolling");
}

}  // namespace geotrain
