// geotrain-misbehaving-worker: one hostile volunteer, for the liveness
// test (test_hostile_worker.py). It is a real worker (the same Worker
// class, the same certificate from a real token) whose pipeline sends
// through a misbehaving wrapper (WorkerOptions::wrap_link), and which uses
// its own key on the side, as a thief of it would. Test-only; never
// installed.
//
//   --misbehave=fake_done         a DONE frame down its link, and ReportDone,
//                                 long before the job's end
//   --misbehave=fake_final_step   ReportStep(the job's last step, loss 0.01)
//   --misbehave=hijack_link       a second link to its downstream neighbour
//                                 with its own key, held open
//   --misbehave=drop_links        ends its links after --after messages, in
//                                 every plan
//   --misbehave=stall             holds its links open and sends nothing
//                                 after --after messages
//   --misbehave=poison_checkpoint uploads its stage's checkpoint with every
//                                 value times -8 (finite) at a step 50 past
//                                 its newest, once, then trains honestly
//   --misbehave=scale_outputs     after --after messages, multiplies every
//                                 activation and gradient it sends by
//                                 --factor, re-encoded and committed to as
//                                 its own (the cheap check on every
//                                 microbatch: issue 35)
//   --misbehave=noise             the same, adding Gaussian noise at --noise
//                                 of each tensor's RMS
//   --misbehave=flip_gradients    the same, the sign of every gradient
//                                 flipped (activations honest)
//   --misbehave=scale_gradients   the same, gradients only, times --factor
//   --misbehave=skip_layer        after --after forward passes, leaves out its
//                                 stage's layer --layer (0: its first; it must
//                                 keep the shapes) from every pass; its
//                                 messages and log are true to what it ran
//   --misbehave=skip_updates      after --after updates, skips every update:
//                                 drops its gradients and publishes its
//                                 weights unchanged as the next version (stale
//                                 weights; its outputs are true to them)
//   --misbehave=dodge_updates     as skip_updates, and counts a weight sync (as
//                                 if an outer step came between) at each, so
//                                 that its update audits are unverifiable
//   --misbehave=lie_as_verifier   trains honestly; fails every spot check it
//                                 is asked to verify (a forged accusation)
// With --lie_every=N (N > 1) the tampering ones lie only on microbatches
// whose id is a multiple of N: a liar that guesses which computations go
// unchecked (the draw's key is the coordinator's, so any guess is as good
// as another), honest on the rest.
// With --consistent_log the tampered message is also what its commitment
// log holds as sent (WorkerOptions::commitment_log): a liar that keeps its
// evidence consistent, whom only the spot checks' recomputation catches.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <random>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/codec.h"
#include "common/commitment.h"
#include "common/layer_state.h"
#include "common/logging.h"
#include "common/plan_util.h"
#include "common/rpc_options.h"
#include "common/status_macros.h"
#include "common/transport_security.h"
#include "geotrain/v1/coordinator.grpc.pb.h"
#include "geotrain/v1/stage.grpc.pb.h"
#include "worker/worker.h"
#include "worker/worker_credentials.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:7070", "coordinator HOST:PORT");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "HOST:PORT of its Stage service");
ABSL_FLAG(std::string, name, "hostile", "its name in status");
ABSL_FLAG(std::string, token, "", "a worker token");
ABSL_FLAG(std::string, state_dir, "", "where its key is kept (required: the attacks use it)");
ABSL_FLAG(std::string, misbehave, "",
          "fake_done|fake_final_step|hijack_link|drop_links|stall|poison_checkpoint");
ABSL_FLAG(int, after, 20, "messages each plan's pipeline sends honestly first");
ABSL_FLAG(int, claim_step, 0, "the step its false claims name (the job's last)");
ABSL_FLAG(double, factor, 10, "scale_outputs: what its outputs are multiplied by");
ABSL_FLAG(int, lie_every, 1,
          "scale_outputs, noise, flip_gradients, scale_gradients: tamper only with "
          "microbatches whose id is a multiple of this (a guess at the unchecked ones)");
ABSL_FLAG(double, noise, 0.01, "noise: the noise's standard deviation over each tensor's RMS");
ABSL_FLAG(int, layer, 0, "skip_layer: which of its stage's layers it leaves out");
ABSL_FLAG(bool, consistent_log, false,
          "log the tampered messages as sent (the spot checks' adversary)");

namespace geotrain {
namespace {

enum class Misbehaviour {
  kFakeDone,
  kFakeFinalStep,
  kHijackLink,
  kDropLinks,
  kStall,
  kPoisonCheckpoint,
  kScaleOutputs,
  kNoise,
  kFlipGradients,
  kScaleGradients,
  kSkipLayer,
  kSkipUpdates,
  kDodgeUpdates,
  kLieAsVerifier
};

bool Tampers(Misbehaviour how) {
  return how == Misbehaviour::kScaleOutputs || how == Misbehaviour::kNoise ||
         how == Misbehaviour::kFlipGradients || how == Misbehaviour::kScaleGradients;
}

// `message` with its first tensor (the activation or the gradient; float32)
// changed by `change`, encoded as before and committed to.
absl::StatusOr<LinkMessage> Transformed(const LinkMessage& message,
                                        const std::function<void(std::vector<float>&)>& change) {
  const v1::TensorHeader& header = message.header.tensors(0);
  absl::string_view bytes(message.payload.data(), header.payload_bytes());
  std::string decompressed;
  if (header.zstd()) {
    ASSIGN_OR_RETURN(decompressed, ZstdDecompress(bytes, header.encoded_bytes()));
    bytes = decompressed;
  }
  uint64_t n = 1;
  for (int64_t d : header.shape()) n *= static_cast<uint64_t>(d);
  std::vector<float> values(n);
  CodecOptions options;
  options.block_size = header.block_size() > 0 ? static_cast<int>(header.block_size()) : 64;
  std::unique_ptr<Codec> codec;
  if (header.codec() == v1::CODEC_NONE) {
    if (bytes.size() != n * sizeof(float)) return absl::InvalidArgumentError("size");
    std::memcpy(values.data(), bytes.data(), bytes.size());
  } else {
    ASSIGN_OR_RETURN(codec, MakeCodec(header.codec(), options));
    RETURN_IF_ERROR(codec->Decode(bytes, n, values.data()));
  }
  change(values);
  std::string encoded;
  if (codec == nullptr) {
    encoded.assign(reinterpret_cast<const char*>(values.data()), n * sizeof(float));
  } else {
    RETURN_IF_ERROR(codec->Encode(values.data(), n, &encoded));
  }
  LinkMessage out;
  out.header = message.header;
  v1::TensorHeader* changed = out.header.mutable_tensors(0);
  changed->set_encoded_bytes(encoded.size());
  if (header.zstd()) {
    std::string compressed;
    RETURN_IF_ERROR(ZstdCompress(encoded, 1, &compressed));
    encoded = std::move(compressed);
  }
  changed->set_payload_bytes(encoded.size());
  out.payload = std::move(encoded);
  out.payload.append(message.payload, header.payload_bytes(), std::string::npos);
  out.header.set_commitment(CommitmentOf(out.header, out.payload));
  return out;
}

// Its stage's newest checkpoint, every float times -8, 50 steps on,
// uploaded as its own. Returns what it says of it (for the test to read).
std::string PoisonCheckpoint(v1::Coordinator::Stub& stub, const std::string& self,
                             const v1::StageAssignment& stage) {
  std::vector<v1::LayerCheckpoint> layers;
  for (int layer = stage.layer_begin(); layer < stage.layer_end(); ++layer) {
    grpc::ClientContext context;
    context.set_deadline(DeadlineFromNow(std::chrono::seconds(10)));
    v1::LoadCheckpointRequest request;
    request.set_worker_id(self);
    request.set_layer(layer);
    auto reader = stub.LoadCheckpoint(&context, request);
    LayerStateCollector collector;
    LayerStateReceiver receiver(&collector, uint64_t{1} << 30);
    v1::LayerStateChunk chunk;
    while (reader->Read(&chunk)) {
      if (!receiver.Add(chunk).ok()) break;
    }
    const grpc::Status status = reader->Finish();
    if (!status.ok() || collector.layers().size() != 1) {
      return absl::StrCat("no checkpoint of layer ", layer, " to poison yet: ",
                          status.error_message());
    }
    layers.push_back(std::move(collector.layers()[0]));
  }
  const int step = layers[0].step() + 50;
  grpc::ClientContext context;
  context.set_deadline(DeadlineFromNow(std::chrono::seconds(10)));
  v1::SaveCheckpointResponse response;
  auto writer = stub.SaveCheckpoint(&context, &response);
  for (v1::LayerCheckpoint& layer : layers) {
    layer.set_step(step);
    std::string* payload = layer.mutable_payload();
    for (size_t i = 0; i + 4 <= payload->size(); i += 4) {
      float value;
      std::memcpy(&value, payload->data() + i, 4);
      value *= -8.0f;
      std::memcpy(payload->data() + i, &value, 4);
    }
    ForEachLayerStateChunk(layer, kLayerStateChunkBytes,
                           [&](const v1::LayerStateChunk& c) { return writer->Write(c); });
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  return absl::StrCat("poisoned checkpoint of layers [", stage.layer_begin(), ",",
                      stage.layer_end(), ") at step ", step, ": ",
                      status.ok() ? "accepted" : status.error_message());
}

// The plan epoch of the newest message this worker's real pipeline sent
// downstream: the hijack waits for it, so that its link is the second one
// (it raced the real link's first dial, and won, while the neighbour
// downstream had not started its session yet).
std::atomic<uint64_t> last_downstream_epoch{0};

// What the pipeline sends toward one neighbour, for one plan.
class HostileSink : public MessageSink {
 public:
  HostileSink(Misbehaviour how, PeerSide toward, MessageSink* real, int after, int claim_step,
              float factor, double noise, int lie_every, CommitmentLog* log)
      : how_(how),
        toward_(toward),
        real_(real),
        after_(after),
        claim_step_(claim_step),
        factor_(factor),
        noise_(noise),
        lie_every_(std::max(1, lie_every)),
        log_(log) {}

  absl::Status Send(LinkMessage message) override {
    if (toward_ == PeerSide::kDownstream) {
      last_downstream_epoch.store(message.header.epoch());
    }
    const bool honest = sent_++ < after_;
    if (honest) return real_->Send(std::move(message));
    switch (how_) {
      case Misbehaviour::kFakeDone:
        if (toward_ == PeerSide::kDownstream && !done_sent_) {
          done_sent_ = true;
          GT_LOG(Warning) << "hostile: a DONE frame at message " << sent_;
          LinkMessage done;
          done.header = message.header;
          done.header.set_kind(v1::MESSAGE_KIND_DONE);
          done.header.set_step(claim_step_);
          done.header.clear_tensors();
          (void)real_->Send(std::move(done));
        }
        return real_->Send(std::move(message));
      case Misbehaviour::kDropLinks:
        GT_LOG(Warning) << "hostile: dropping the link at message " << sent_;
        return absl::UnavailableError("hostile: link dropped");
      case Misbehaviour::kStall:
        if (sent_ == after_ + 1) GT_LOG(Warning) << "hostile: stalling the link";
        return absl::OkStatus();  // swallowed; the stream stays open
      case Misbehaviour::kScaleOutputs:
      case Misbehaviour::kNoise:
      case Misbehaviour::kFlipGradients:
      case Misbehaviour::kScaleGradients: {
        const v1::MessageKind kind = message.header.kind();
        const bool gradients_only =
            how_ == Misbehaviour::kFlipGradients || how_ == Misbehaviour::kScaleGradients;
        if ((kind != v1::MESSAGE_KIND_ACTIVATION && kind != v1::MESSAGE_KIND_GRADIENT) ||
            (gradients_only && kind != v1::MESSAGE_KIND_GRADIENT) ||
            message.header.tensors_size() == 0 ||
            message.header.tensors(0).dtype() != v1::DTYPE_FLOAT32 ||
            message.header.microbatch() % lie_every_ != 0) {
          return real_->Send(std::move(message));
        }
        absl::StatusOr<LinkMessage> changed = Transformed(message, [this](std::vector<float>& v) {
          Change(v);
        });
        if (!changed.ok()) return real_->Send(std::move(message));
        if (!scaling_logged_) {
          scaling_logged_ = true;
          GT_LOG(Warning) << "hostile: scaling its outputs by " << factor_ << " ("
                          << absl::GetFlag(FLAGS_misbehave) << ") from message " << sent_;
        }
        // A liar in control of its code logs what it sent.
        if (log_ != nullptr) log_->RecordSent(*changed, absl::Now());
        return real_->Send(*std::move(changed));
      }
      default:
        return real_->Send(std::move(message));
    }
  }
  void OnReply(uint64_t microbatch) override { real_->OnReply(microbatch); }

  void Change(std::vector<float>& values) {
    switch (how_) {
      case Misbehaviour::kNoise: {
        double sum = 0;
        for (float v : values) sum += static_cast<double>(v) * v;
        const double rms = values.empty() ? 0 : std::sqrt(sum / values.size());
        std::normal_distribution<float> noise(0.0f, static_cast<float>(noise_ * rms));
        for (float& v : values) v += noise(random_);
        break;
      }
      case Misbehaviour::kFlipGradients:
        for (float& v : values) v = -v;
        break;
      default:
        for (float& v : values) v *= factor_;
    }
  }
  std::string failed_peer() const override { return real_->failed_peer(); }
  std::string oldest_pending_peer() const override { return real_->oldest_pending_peer(); }

 private:
  const Misbehaviour how_;
  const PeerSide toward_;
  MessageSink* const real_;
  const int after_;
  const int claim_step_;
  const float factor_;
  const double noise_;
  const int lie_every_;
  CommitmentLog* const log_;
  std::mt19937 random_{12345};
  int sent_ = 0;
  bool done_sent_ = false;
  bool scaling_logged_ = false;
};

// The side attacks, with this worker's own key (loaded from --state_dir
// once the worker has enrolled), in a loop until the process ends.
void SideAttacks(Misbehaviour how, const std::string& coordinator, const std::string& state_dir,
                 const std::string& name, int claim_step) {
  std::atomic<bool> never{false};
  WorkerCredentialOptions options;
  options.coordinator = coordinator;
  options.state_dir = state_dir;
  options.name = name;
  absl::StatusOr<WorkerCredentials> credentials;
  while (true) {
    credentials = ObtainWorkerCredentials(options, never, absl::Seconds(1));
    if (credentials.ok()) break;
    absl::SleepFor(absl::Seconds(1));  // not enrolled yet
  }
  auto stub = v1::Coordinator::NewStub(
      MakeSecureChannel(coordinator, credentials->coordinator, kCoordinatorServerName));
  const std::string self = credentials->worker_id;
  // The plans, as this worker sees them.
  absl::Mutex mu;
  std::optional<v1::Plan> plan;
  std::thread([&] {
    while (true) {
      grpc::ClientContext context;
      v1::WatchPlanRequest request;
      request.set_worker_id(self);
      auto reader = stub->WatchPlan(&context, request);
      v1::Plan next;
      while (reader->Read(&next)) {
        absl::MutexLock lock(&mu);
        plan = next;
      }
      reader->Finish();
      absl::SleepFor(absl::Seconds(1));
    }
  }).detach();
  bool poisoned = false;
  std::unique_ptr<grpc::ClientContext> held_context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::LinkFrame, v1::LinkFrame>> held;
  uint64_t held_epoch = 0;
  while (true) {
    absl::SleepFor(absl::Seconds(1));
    std::optional<v1::Plan> now;
    {
      absl::MutexLock lock(&mu);
      now = plan;
    }
    if (!now.has_value() || now->job_done()) continue;
    grpc::ClientContext context;
    context.set_deadline(DeadlineFromNow(std::chrono::seconds(5)));
    v1::ReportAck ack;
    if (how == Misbehaviour::kFakeDone) {
      v1::DoneReport done;
      done.set_worker_id(self);
      done.set_step(claim_step);
      const grpc::Status status = stub->ReportDone(&context, done, &ack);
      GT_LOG(Info) << "hostile: ReportDone: " << (status.ok() ? "accepted" : status.error_message());
    } else if (how == Misbehaviour::kFakeFinalStep) {
      v1::StepReport step;
      step.set_worker_id(self);
      step.set_epoch(now->epoch());
      step.set_step(claim_step);
      step.set_loss(0.01);
      step.set_samples(1);
      const grpc::Status status = stub->ReportStep(&context, step, &ack);
      GT_LOG(Info) << "hostile: ReportStep(" << claim_step
                   << "): " << (status.ok() ? "accepted" : status.error_message());
    } else if (how == Misbehaviour::kPoisonCheckpoint && !poisoned) {
      const v1::StageAssignment* mine = StageOf(*now, self);
      if (mine == nullptr || mine->worker_id() != self) continue;
      const std::string outcome = PoisonCheckpoint(*stub, self, *mine);
      GT_LOG(Warning) << "hostile: " << outcome;
      poisoned = outcome.find(": accepted") != std::string::npos;
    } else if (how == Misbehaviour::kHijackLink && held_epoch != now->epoch() &&
               last_downstream_epoch.load() == now->epoch()) {
      // A second link to the neighbour downstream, as this worker.
      const v1::StageAssignment* mine = StageOf(*now, self);
      if (mine == nullptr || mine->stage() + 1 >= now->stages_size()) continue;
      const v1::StageAssignment& next = now->stages(mine->stage() + 1);
      held.reset();
      held_context = std::make_unique<grpc::ClientContext>();
      auto peer = v1::Stage::NewStub(
          MakeSecureChannel(next.address(), credentials->peers, next.worker_id()));
      held = peer->Link(held_context.get());
      v1::LinkFrame hello;
      hello.mutable_header()->set_kind(v1::MESSAGE_KIND_HELLO);
      hello.mutable_header()->set_epoch(now->epoch());
      hello.mutable_header()->set_from_stage(mine->stage());
      hello.mutable_header()->set_from_worker(self);
      hello.mutable_header()->set_to_worker(next.worker_id());
      hello.set_last(true);
      held->Write(hello);
      v1::LinkFrame answer;
      const bool answered = held->Read(&answer);
      GT_LOG(Warning) << "hostile: second link to " << next.worker_id() << " in epoch "
                      << now->epoch() << ": "
                      << (answered ? "answered" : held->Finish().error_message());
      held_epoch = now->epoch();
    }
  }
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string kind = absl::GetFlag(FLAGS_misbehave);
  Misbehaviour how;
  if (kind == "fake_done") {
    how = Misbehaviour::kFakeDone;
  } else if (kind == "fake_final_step") {
    how = Misbehaviour::kFakeFinalStep;
  } else if (kind == "hijack_link") {
    how = Misbehaviour::kHijackLink;
  } else if (kind == "drop_links") {
    how = Misbehaviour::kDropLinks;
  } else if (kind == "stall") {
    how = Misbehaviour::kStall;
  } else if (kind == "poison_checkpoint") {
    how = Misbehaviour::kPoisonCheckpoint;
  } else if (kind == "scale_outputs") {
    how = Misbehaviour::kScaleOutputs;
  } else if (kind == "noise") {
    how = Misbehaviour::kNoise;
  } else if (kind == "flip_gradients") {
    how = Misbehaviour::kFlipGradients;
  } else if (kind == "scale_gradients") {
    how = Misbehaviour::kScaleGradients;
  } else if (kind == "skip_layer") {
    how = Misbehaviour::kSkipLayer;
  } else if (kind == "skip_updates") {
    how = Misbehaviour::kSkipUpdates;
  } else if (kind == "dodge_updates") {
    how = Misbehaviour::kDodgeUpdates;
  } else if (kind == "lie_as_verifier") {
    how = Misbehaviour::kLieAsVerifier;
  } else {
    std::fprintf(stderr, "--misbehave: one of fake_done, fake_final_step, hijack_link, "
                         "drop_links, stall, poison_checkpoint, scale_outputs, noise, "
                         "flip_gradients, scale_gradients, skip_layer, skip_updates, "
                         "dodge_updates, lie_as_verifier\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_state_dir).empty()) {
    std::fprintf(stderr, "--state_dir is required\n");
    return 2;
  }
  SetLogPrefix(absl::GetFlag(FLAGS_name));
  WorkerOptions options;
  options.coordinator = absl::GetFlag(FLAGS_coordinator);
  options.listen = absl::GetFlag(FLAGS_listen);
  options.name = absl::GetFlag(FLAGS_name);
  options.token = absl::GetFlag(FLAGS_token);
  options.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.device = "cpu";
  options.threads = 1;
  const int after = absl::GetFlag(FLAGS_after);
  const int claim_step = absl::GetFlag(FLAGS_claim_step);
  const float factor = static_cast<float>(absl::GetFlag(FLAGS_factor));
  const double noise = absl::GetFlag(FLAGS_noise);
  const int lie_every = absl::GetFlag(FLAGS_lie_every);
  // Outlives the worker (a static): the worker keeps it as its own log.
  static CommitmentLog* const consistent_log = new CommitmentLog();
  CommitmentLog* log = absl::GetFlag(FLAGS_consistent_log) && Tampers(how) ? consistent_log
                                                                            : nullptr;
  options.commitment_log = log;
  if (how == Misbehaviour::kSkipLayer) {
    options.tamper_runtime = [after, layer = absl::GetFlag(FLAGS_layer)](RuntimeOptions* o) {
      o->tamper_skip_layer = layer;
      o->tamper_after_forwards = after;
    };
  }
  if (how == Misbehaviour::kSkipUpdates || how == Misbehaviour::kDodgeUpdates) {
    // --after counts updates here: the ones it makes before it stops.
    const bool claim_syncs = how == Misbehaviour::kDodgeUpdates;
    options.tamper_runtime = [after, claim_syncs](RuntimeOptions* o) {
      o->tamper_skip_updates_after = after;
      o->tamper_claim_syncs = claim_syncs;
    };
  }
  if (how == Misbehaviour::kLieAsVerifier) {
    options.tamper_verdict = [](v1::AuditVerdict* verdict) {
      if (!verdict->ran()) return;
      GT_LOG(Warning) << "hostile: failing audit " << verdict->audit_id()
                      << " it found: " << verdict->summary();
      verdict->set_passed(false);
      verdict->set_summary("FAILED: every element outside the bound (a lie)");
    };
  }
  options.wrap_link = [how, after, claim_step, factor, noise, lie_every, log](
                          PeerSide toward, MessageSink* real) {
    return std::make_unique<HostileSink>(how, toward, real, after, claim_step, factor, noise,
                                         lie_every, log);
  };
  std::thread(SideAttacks, how, options.coordinator, options.state_dir, options.name, claim_step)
      .detach();
  Worker worker(options);
  const absl::Status status = worker.Run();
  GT_LOG(Info) << "hostile worker ended: " << status;
  return status.ok() ? 0 : 1;
}

}  // namespace
}  // namespace geotrain

int main(int argc, char** argv) { return geotrain::Main(argc, argv); }
