// One link of the pipeline, alone: a stage-0 sender pushes activation
// messages as fast as the link takes them to a stage-1 receiver, directly
// (gRPC over mTLS, as a worker dials its neighbour) or through a relay
// (TLS 1.3 end to end over SpliceRelay, as two NATed workers meet). The same
// code paths as the worker's (OpenLink, LinkService, LinkEnd, SpliceRelay);
// bench/relay_goodput runs it across the network lab.
//
//   link_goodput --role=credentials --dir=D
//   link_goodput --role=relay --listen=H:P --rendezvous=R
//   link_goodput --role=receive --dir=D (--listen=H:P | --relay=H:P --rendezvous=R) --messages=N
//   link_goodput --role=send --dir=D (--target=H:P | --relay=H:P --rendezvous=R) --messages=N
//
// The receiver prints one JSON line: goodput from the first message's
// arrival to the last's (so the link's start-up is not counted).
#include <signal.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/files.h"
#include "common/model_profile.h"
#include "common/rpc_options.h"
#include "common/transport_security.h"
#include "common/x509.h"
#include "relay/splice_relay.h"
#include "worker/link_dialer.h"
#include "worker/link_service.h"

ABSL_FLAG(std::string, role, "", "credentials, relay, receive or send");
ABSL_FLAG(std::string, dir, "", "where the credentials are");
ABSL_FLAG(std::string, listen, "", "receiver or relay: HOST:PORT");
ABSL_FLAG(std::string, target, "", "sender: the receiver's HOST:PORT (direct)");
ABSL_FLAG(std::string, relay, "", "through this relay HOST:PORT");
ABSL_FLAG(std::string, rendezvous, "0123456789abcdef0123456789abcdef", "the link's rendezvous");
ABSL_FLAG(int, messages, 64, "activation messages to send");
ABSL_FLAG(int, batch, 1024, "microbatch size (x 1 KiB per message)");

namespace geotrain {
namespace {

int Fail(const std::string& what) {
  std::fprintf(stderr, "link_goodput: %s\n", what.c_str());
  return 1;
}

v1::JobSpec Job() {
  v1::JobSpec job;
  job.set_name("link-goodput");
  job.mutable_mlp()->add_hidden(256);
  job.mutable_mlp()->add_hidden(128);
  job.mutable_fashion_mnist()->set_dir("/nonexistent");
  job.set_microbatch_size(absl::GetFlag(FLAGS_batch));
  job.set_microbatches(1);
  return job;
}

LinkMessage Activation(const v1::JobSpec& job, uint64_t microbatch) {
  LinkMessage m;
  m.header.set_kind(v1::MESSAGE_KIND_ACTIVATION);
  m.header.set_epoch(1);
  m.header.set_microbatch(microbatch);
  m.header.set_from_stage(0);
  const int64_t batch = job.microbatch_size();
  TensorSpec act = LayerInputSpec(job, 1, batch);
  v1::TensorHeader* a = m.header.add_tensors();
  int64_t n = 1;
  for (int64_t d : act.shape) {
    a->add_shape(d);
    n *= d;
  }
  a->set_dtype(v1::DTYPE_FLOAT32);
  a->set_codec(v1::CODEC_NONE);
  a->set_payload_bytes(n * 4);
  std::vector<float> values(n);
  for (int64_t i = 0; i < n; ++i) values[i] = std::sin(0.001f * (i + microbatch));
  m.payload.assign(reinterpret_cast<const char*>(values.data()), n * 4);
  v1::TensorHeader* t = m.header.add_tensors();
  t->add_shape(batch);
  t->set_dtype(v1::DTYPE_INT64);
  t->set_codec(v1::CODEC_NONE);
  t->set_payload_bytes(batch * 8);
  std::vector<int64_t> labels(batch, 3);
  m.payload.append(reinterpret_cast<const char*>(labels.data()), batch * 8);
  return m;
}

v1::PlannedLink Relayed() {
  v1::PlannedLink link;
  link.set_upstream_worker("w0");
  link.set_downstream_worker("w1");
  link.set_dialer(v1::LINK_DIALER_RELAY);
  link.set_relay_worker("relay");
  link.set_relay_address(absl::GetFlag(FLAGS_relay));
  link.set_rendezvous(absl::GetFlag(FLAGS_rendezvous));
  // The ends' proofs (a plan's are random); the relay role knows both.
  link.set_upstream_proof(std::string(32, 'a'));
  link.set_downstream_proof(std::string(32, 'b'));
  return link;
}

int MakeCredentials(const std::string& dir) {
  auto ca = CreateCertificateAuthority("link-goodput CA", absl::Hours(24));
  if (!ca.ok()) return Fail(std::string(ca.status().message()));
  for (const std::string id : {"w0", "w1"}) {
    IssueOptions options;
    options.common_name = id;
    options.dns_names = {id};
    auto key = IssueCertifiedKey(*ca, options);
    if (!key.ok()) return Fail(std::string(key.status().message()));
    TransportSecurity security;
    security.insecure = false;
    security.certificate_pem = key->certificate_pem;
    security.private_key_pem = key->private_key_pem;
    security.trusted_ca_pem = ca->certificate_pem;
    absl::Status written = WriteFileAtomically(
        dir + "/" + id + ".credential", FormatCredentialFile("link_goodput " + id, security), 0600);
    if (!written.ok()) return Fail(std::string(written.message()));
  }
  return 0;
}

int Relay() {
  SpliceRelayOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  auto relay = SpliceRelay::Start(options);
  if (!relay.ok()) return Fail(std::string(relay.status().message()));
  (*relay)->SetLinks({{absl::GetFlag(FLAGS_rendezvous),
                       {Relayed().upstream_proof(), Relayed().downstream_proof()}}});
  std::fprintf(stderr, "relay on port %d\n", (*relay)->port());
  while (true) absl::SleepFor(absl::Seconds(60));
}

int Receive(const LinkOptions& options) {
  const v1::JobSpec job = Job();
  const int layers = NumLayers(job);
  auto validator = std::make_shared<const LinkValidator>(job, 1, 1, 1, layers,
                                                         std::set<std::string>{"w0"});
  auto inbox = std::make_shared<Inbox>(64);
  LinkService service(options);
  service.SetWorkerId("w1");
  service.Activate(validator, inbox, {});
  std::unique_ptr<grpc::Server> server;
  std::shared_ptr<LinkEnd> relayed;
  std::atomic<bool> stop{false};
  if (!absl::GetFlag(FLAGS_relay).empty()) {
    const v1::PlannedLink link = Relayed();
    DialTarget target{"w1", 1, {"w0", "", PeerSide::kUpstream}, &link};
    auto end = OpenLink(target, validator, inbox, options, &service, &stop);
    if (!end.ok()) return Fail(std::string(end.status().message()));
    relayed = *end;
  } else {
    grpc::ServerBuilder builder;
    ConfigureServerBuilder(&builder);
    builder.AddListeningPort(absl::GetFlag(FLAGS_listen),
                             MakeServerCredentials(options.transport, ClientCertificates::kRequire));
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    if (server == nullptr) return Fail("cannot listen on " + absl::GetFlag(FLAGS_listen));
  }
  const int messages = absl::GetFlag(FLAGS_messages);
  absl::Time first;
  uint64_t bytes_after_first = 0;
  int received = 0;
  while (received < messages) {
    std::optional<InboundMessage> in = inbox->Pop(absl::Seconds(120));
    if (!in.has_value()) return Fail("no message for 120 s");
    if (!in->error.ok()) return Fail(std::string(in->error.message()));
    if (in->message.header.kind() != v1::MESSAGE_KIND_ACTIVATION) continue;
    if (received == 0) {
      first = absl::Now();
    } else {
      bytes_after_first += in->message.payload.size();
    }
    ++received;
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - first);
  std::printf("{\"messages\": %d, \"bytes\": %lu, \"seconds\": %.3f, \"goodput_mbit\": %.2f}\n",
              received, static_cast<unsigned long>(bytes_after_first), seconds,
              bytes_after_first * 8 / seconds / 1e6);
  std::fflush(stdout);
  if (relayed) relayed->EndOnPurpose();
  service.Shutdown();
  if (server) server->Shutdown(DeadlineFromNow(std::chrono::milliseconds(1000)));
  return 0;
}

int Send(const LinkOptions& options) {
  const v1::JobSpec job = Job();
  auto validator = std::make_shared<const LinkValidator>(job, 1, 0, 0, 1);
  auto inbox = std::make_shared<Inbox>(64);
  LinkService service(options);  // unused for a downstream link, but OpenLink takes one
  std::atomic<bool> stop{false};
  v1::PlannedLink link = Relayed();
  const bool relayed = !absl::GetFlag(FLAGS_relay).empty();
  DialTarget target{"w0", 0, {"w1", absl::GetFlag(FLAGS_target), PeerSide::kDownstream},
                    relayed ? &link : nullptr};
  auto end = OpenLink(target, validator, inbox, options, &service, &stop);
  if (!end.ok()) return Fail(std::string(end.status().message()));
  const int messages = absl::GetFlag(FLAGS_messages);
  for (int i = 0; i < messages; ++i) {
    absl::Status sent = (*end)->Send(Activation(job, i));
    if (!sent.ok()) return Fail(std::string(sent.message()));
  }
  (void)(*end)->Close(absl::Seconds(60));
  return 0;
}

}  // namespace
}  // namespace geotrain

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  absl::ParseCommandLine(argc, argv);
  const std::string role = absl::GetFlag(FLAGS_role);
  const std::string dir = absl::GetFlag(FLAGS_dir);
  if (role == "credentials") return geotrain::MakeCredentials(dir);
  if (role == "relay") return geotrain::Relay();
  if (role != "receive" && role != "send") return geotrain::Fail("--role: credentials, relay, receive or send");
  auto security =
      geotrain::LoadCredentialFile(dir + (role == "receive" ? "/w1.credential" : "/w0.credential"));
  if (!security.ok()) return geotrain::Fail(std::string(security.status().message()));
  geotrain::LinkOptions options;
  options.transport = *security;
  return role == "receive" ? geotrain::Receive(options) : geotrain::Send(options);
}
