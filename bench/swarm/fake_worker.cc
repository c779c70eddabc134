#include "bench/swarm/fake_worker.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "bench/swarm/swarm_model.h"
#include "common/join_token.h"
#include "common/layer_state.h"
#include "common/rpc_options.h"
#include "common/x509.h"

namespace geotrain::swarm {

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

void Latencies::Add(double ms) {
  absl::MutexLock lock(&mu_);
  ms_.push_back(ms);
}

double Latencies::Quantile(double q) const {
  absl::MutexLock lock(&mu_);
  if (ms_.empty()) return 0;
  std::vector<double> sorted = ms_;
  std::sort(sorted.begin(), sorted.end());
  return sorted[std::min(sorted.size() - 1, static_cast<size_t>(q * sorted.size()))];
}

size_t Latencies::size() const {
  absl::MutexLock lock(&mu_);
  return ms_.size();
}

void Latencies::Clear() {
  absl::MutexLock lock(&mu_);
  ms_.clear();
}

void ErrorTally::Add(const std::string& call, grpc::StatusCode code) {
  absl::MutexLock lock(&mu_);
  ++counts_[{call, static_cast<int>(code)}];
}

std::string ErrorTally::Summary(const std::string& call) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<int, int>> by_count;
  for (const auto& [key, n] : counts_) {
    if (key.first == call) by_count.push_back({n, key.second});
  }
  std::sort(by_count.rbegin(), by_count.rend());
  std::string out;
  for (const auto& [n, code] : by_count) {
    absl::StrAppend(&out, out.empty() ? "" : ", ",
                    absl::StatusCodeToString(static_cast<absl::StatusCode>(code)), " ", n);
  }
  return out;
}

Timers::Timers() {
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      if (queue_.empty()) {
        cv_.wait(lock);
        continue;
      }
      if (queue_.top().due > Clock::now()) {
        cv_.wait_until(lock, queue_.top().due);
        continue;
      }
      std::function<void()> f = queue_.top().f;
      queue_.pop();
      lock.unlock();
      f();
      lock.lock();
    }
  });
}

Timers::~Timers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Timers::After(std::chrono::milliseconds delay, std::function<void()> f) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push({Clock::now() + delay, next_++, std::move(f)});
  }
  cv_.notify_all();
}

namespace {

std::chrono::system_clock::time_point In(absl::Duration d) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d);
}

// The index of a fake worker from the address it advertises.
int IndexOfAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port)) return 0;
  return std::max(0, port - 7000);
}

// The access link a speed class has (bits/s): a GPU host 1 Gb/s, a fast
// CPU 200 Mb/s, a slow one 50 Mb/s.
double AccessRate(int index) {
  const double gflops = SpeedClassOf(index).matmul_gflops;
  return gflops > 1000 ? 1e9 : gflops > 100 ? 2e8 : 5e7;
}

// Counts a call from before it is made until its callback ends.
class CallInFlight {
 public:
  explicit CallInFlight(SwarmContext* swarm) : swarm_(swarm) {}
  ~CallInFlight() { --swarm_->calls_in_flight; }

 private:
  SwarmContext* const swarm_;
};

}  // namespace

class FakeWorker::PlanReader : public grpc::ClientReadReactor<v1::Plan> {
 public:
  PlanReader(FakeWorker* worker, v1::Coordinator::Stub* stub, const std::string& id)
      : worker_(worker) {
    ++worker_->swarm_->streams_open;
    request_.set_worker_id(id);
    stub->async()->WatchPlan(&context_, &request_, this);
    StartRead(&plan_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    worker_->OnPlan(plan_);
    StartRead(&plan_);
  }
  void OnDone(const grpc::Status&) override {
    done_ = true;
    worker_->OnPlanStreamEnded();
    --worker_->swarm_->streams_open;  // the worker may be freed after it
    finished_ = true;                 // last: this reader may be freed after it
  }
  void Cancel() { context_.TryCancel(); }
  bool done() const { return done_; }
  bool finished() const { return finished_; }

 private:
  FakeWorker* const worker_;
  grpc::ClientContext context_;
  v1::WatchPlanRequest request_;
  v1::Plan plan_;
  std::atomic<bool> done_{false}, finished_{false};
};

FakeWorker::FakeWorker(int index, SwarmContext* swarm)
    : index_(index),
      swarm_(swarm),
      name_(absl::StrCat("fake-", index)),
      session_(RandomHexSecret(8)) {}

FakeWorker::~FakeWorker() { Stop(); }

std::string FakeWorker::id() const {
  absl::MutexLock lock(&mu_);
  return id_;
}

std::set<std::string> FakeWorker::plan_members() const {
  absl::MutexLock lock(&mu_);
  return plan_members_;
}

bool FakeWorker::AttachedSince(Clock::time_point since) const {
  const int64_t ns = last_known_heartbeat_ns_;
  if (ns < since.time_since_epoch().count()) return false;
  absl::MutexLock lock(&mu_);
  return reader_ != nullptr && !reader_->done() && epoch_ > 0;
}

v1::Coordinator::Stub* FakeWorker::SharedStub() const {
  return swarm_->shared_stubs[index_ % swarm_->shared_stubs.size()].get();
}

v1::Coordinator::Stub* FakeWorker::StubLocked() const {
  return own_stub_ != nullptr ? own_stub_.get() : SharedStub();
}

v1::Coordinator::Stub* FakeWorker::stub() const {
  absl::MutexLock lock(&mu_);
  return StubLocked();
}

void FakeWorker::Retry(std::function<void()> f, std::atomic<int>* attempts) {
  if (stopped_) return;
  // 0.5 s, doubling to 8 s, each jittered: a thousand workers that failed
  // together do not come back together.
  const int shift = std::min(attempts->fetch_add(1), 4);
  const absl::Duration delay = Jittered(absl::Milliseconds(500) * (1 << shift));
  swarm_->timers->After(absl::ToChronoMilliseconds(delay), std::move(f));
}

void FakeWorker::Start() {
  if (swarm_->tls) {
    Enroll();
  } else {
    Join();
  }
}

void FakeWorker::Enroll() {
  if (stopped_) return;
  absl::StatusOr<std::string> key = GeneratePrivateKeyPem();
  absl::StatusOr<std::string> csr =
      key.ok() ? CreateCsrPem(*key, "geotrain worker") : key.status();
  if (!csr.ok()) {
    ++swarm_->enroll_errors;
    Retry([this] { Enroll(); }, &enroll_attempts_);
    return;
  }
  auto context = std::make_shared<grpc::ClientContext>();
  context->set_deadline(In(absl::Seconds(10)));
  auto request = std::make_shared<v1::EnrollRequest>();
  request->set_token(swarm_->token);
  request->set_csr_pem(*csr);
  request->set_name(name_);
  auto response = std::make_shared<v1::EnrollResponse>();
  const Clock::time_point sent = Clock::now();
  v1::Coordinator::Stub* shared = SharedStub();
  ++swarm_->calls_in_flight;
  shared->async()->Enroll(
      context.get(), request.get(), response.get(),
      [this, context, request, response, sent, key = *key](grpc::Status status) {
        CallInFlight counted(swarm_);
        if (!status.ok()) {
          ++swarm_->enroll_errors;
          swarm_->errors.Add("Enroll", status.error_code());
          Retry([this] { Enroll(); }, &enroll_attempts_);
          return;
        }
        swarm_->enroll_ms.Add(SecondsSince(sent) * 1000);
        ++swarm_->enrolled;
        {
          absl::MutexLock lock(&mu_);
          id_ = response->worker_id();
          security_.insecure = false;
          security_.trusted_ca_pem = swarm_->coordinator_ca_pem;
          security_.certificate_pem = response->certificate_pem();
          security_.private_key_pem = key;
          own_stub_ = v1::Coordinator::NewStub(MakeSecureChannel(
              swarm_->address, security_, kCoordinatorServerName, Connection::kOwn));
        }
        Join();
      });
}

void FakeWorker::Join() {
  if (stopped_ || silent_) return;
  auto context = std::make_shared<grpc::ClientContext>();
  context->set_deadline(In(absl::Seconds(5)));
  auto request = std::make_shared<v1::JoinRequest>();
  request->set_name(name_);
  request->set_address(absl::StrCat("192.0.2.", 1 + index_ % 250, ":", 7000 + index_));
  request->set_session_id(session_);
  *request->mutable_device() = DeviceOf(index_);
  auto response = std::make_shared<v1::JoinResponse>();
  const Clock::time_point sent = Clock::now();
  ++swarm_->calls_in_flight;
  stub()->async()->Join(context.get(), request.get(), response.get(),
                        [this, context, request, response, sent](grpc::Status status) {
        CallInFlight counted(swarm_);
                          if (!status.ok()) {
                            ++swarm_->join_errors;
                            swarm_->errors.Add("Join", status.error_code());
                            Retry([this] { Join(); }, &join_attempts_);
                            return;
                          }
                          swarm_->join_ms.Add(SecondsSince(sent) * 1000);
                          {
                            absl::MutexLock lock(&mu_);
                            id_ = response->worker_id();
                          }
                          join_attempts_ = 0;
                          joined_ = true;
                          if (!ever_joined_.exchange(true)) ++swarm_->joined;
                          OpenPlanStream();
                        });
}

void FakeWorker::OpenPlanStream() {
  if (stopped_ || silent_) return;
  absl::MutexLock lock(&mu_);
  if (reader_ != nullptr && !reader_->done()) return;
  if (reader_ != nullptr) ended_readers_.push_back(std::move(reader_));
  // A finished reader's context holds its call, and the call its
  // connection: kept, every reconnect kept a socket (at 10,000 workers
  // this process ran out of its 20,000 descriptors).
  ended_readers_.erase(std::remove_if(ended_readers_.begin(), ended_readers_.end(),
                                      [](const std::unique_ptr<PlanReader>& r) {
                                        return r->finished();
                                      }),
                       ended_readers_.end());
  reader_ = std::make_unique<PlanReader>(this, StubLocked(), id_);
  ++swarm_->plan_streams_opened;
}

void FakeWorker::OnPlanStreamEnded() {
  if (stopped_ || silent_) return;
  // The coordinator went away (or restarts): reopen, jittered.
  Retry([this] { OpenPlanStream(); }, &stream_attempts_);
}

void FakeWorker::OnPlan(const v1::Plan& plan) {
  ++swarm_->plans_received;
  stream_attempts_ = 0;
  {
    absl::MutexLock lock(&swarm_->plans_mu);
    auto [it, first] = swarm_->epoch_first_seen.emplace(plan.epoch(), Clock::now());
    if (!first) {
      swarm_->plan_fanout_ms.Add(
          std::chrono::duration<double, std::milli>(Clock::now() - it->second).count());
    }
  }
  bool start_reporting = false, start_checkpoints = false;
  {
    absl::MutexLock lock(&mu_);
    epoch_ = plan.epoch();
    plan_members_.clear();
    last_of_pipeline_ = -1;
    primary_begin_ = primary_end_ = 0;
    for (int s = 0; s < plan.stages_size(); ++s) {
      const v1::StageAssignment& stage = plan.stages(s);
      const bool last = s + 1 == plan.stages_size();
      plan_members_.insert(stage.worker_id());
      if (stage.worker_id() == id_ && !plan.job_done()) {
        primary_begin_ = stage.layer_begin();
        primary_end_ = stage.layer_end();
      }
      if (last && stage.worker_id() == id_) last_of_pipeline_ = 0;
      for (const v1::Replica& r : stage.replicas()) {
        plan_members_.insert(r.worker_id());
        if (last && r.worker_id() == id_) last_of_pipeline_ = r.pipeline();
      }
    }
    if (last_of_pipeline_ >= 0) {
      int start = plan.start_step();
      for (const v1::PipelineInfo& info : plan.pipeline_info()) {
        if (info.pipeline() == last_of_pipeline_) start = info.start_step();
      }
      next_step_ = std::max(next_step_, start + 1);
      next_step_ = std::max(next_step_, swarm_->newest_step.load() + 1);
      if (!reporting_ && swarm_->steps_per_second > 0) start_reporting = reporting_ = true;
    }
    if (primary_end_ > primary_begin_ && !checkpointing_ && swarm_->checkpoint_period_s > 0) {
      start_checkpoints = checkpointing_ = true;
    }
  }
  if (start_reporting) ReportSteps();
  if (start_checkpoints) {
    // The first a period after the plan (as a worker's checkpoint_every
    // steps), jittered: the stages of a plan do not upload together.
    swarm_->timers->After(
        absl::ToChronoMilliseconds(Jittered(absl::Seconds(swarm_->checkpoint_period_s))),
        [this] { SaveCheckpoints(); });
  }
}

void FakeWorker::SaveCheckpoints() {
  std::vector<v1::LayerCheckpoint> layers;
  v1::Coordinator::Stub* s = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_ || silent_ || primary_end_ <= primary_begin_) {
      checkpointing_ = false;
      return;
    }
    // A step the job has reached (the gate refuses one from the future).
    const int step = std::max(1, swarm_->newest_step.load());
    for (int layer = primary_begin_; layer < primary_end_; ++layer) {
      layers.push_back(ZeroLayerCheckpoint(swarm_->job, id_, layer, step));
    }
    s = StubLocked();
  }
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(10)));
  v1::SaveCheckpointResponse response;
  const Clock::time_point sent = Clock::now();
  uint64_t bytes = 0;
  {
    std::unique_ptr<grpc::ClientWriter<v1::LayerStateChunk>> writer =
        s->SaveCheckpoint(&context, &response);
    for (const v1::LayerCheckpoint& layer : layers) {
      bytes += layer.payload().size();
      if (!ForEachLayerStateChunk(layer, kStreamPartBytes, [&](const v1::LayerStateChunk& chunk) {
            return writer->Write(chunk);
          })) {
        break;
      }
    }
    writer->WritesDone();
    const grpc::Status finished = writer->Finish();
    if (finished.ok()) {
      ++swarm_->checkpoints_saved;
      swarm_->checkpoint_bytes += bytes;
      swarm_->checkpoint_ms.Add(SecondsSince(sent) * 1000);
    } else {
      ++swarm_->checkpoint_errors;
      swarm_->errors.Add("SaveCheckpoint", finished.error_code());
    }
  }
  swarm_->timers->After(
      std::chrono::milliseconds(static_cast<int>(1000 * swarm_->checkpoint_period_s)),
      [this] { SaveCheckpoints(); });
}

void FakeWorker::ReportSteps() {
  auto request = std::make_shared<v1::StepReport>();
  v1::Coordinator::Stub* s = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_ || silent_ || last_of_pipeline_ < 0) {
      reporting_ = false;
      return;
    }
    request->set_worker_id(id_);
    request->set_epoch(epoch_);
    request->set_step(next_step_++);
    request->set_loss(4.0 / (1 + 0.01 * request->step()));
    request->set_samples(8);
    s = StubLocked();
  }
  auto context = std::make_shared<grpc::ClientContext>();
  context->set_deadline(In(absl::Seconds(5)));
  auto ack = std::make_shared<v1::ReportAck>();
  ++swarm_->calls_in_flight;
  s->async()->ReportStep(context.get(), request.get(), ack.get(),
                         [this, context, request, ack](grpc::Status status) {
        CallInFlight counted(swarm_);
                           if (status.ok()) {
                             ++swarm_->steps_reported;
                             int newest = swarm_->newest_step;
                             while (request->step() > newest &&
                                    !swarm_->newest_step.compare_exchange_weak(newest,
                                                                               request->step())) {
                             }
                           } else {
                             ++swarm_->step_errors;
                           }
                         });
  swarm_->timers->After(
      std::chrono::milliseconds(static_cast<int>(1000 / swarm_->steps_per_second)),
      [this] { ReportSteps(); });
}

void FakeWorker::Heartbeat() {
  if (stopped_ || silent_ || !joined_) return;
  auto context = std::make_shared<grpc::ClientContext>();
  context->set_deadline(In(absl::Seconds(5)));
  auto request = std::make_shared<v1::HeartbeatRequest>();
  {
    absl::MutexLock lock(&mu_);
    request->set_worker_id(id_);
    for (v1::ProbeResult& r : probe_results_) *request->add_probe_results() = std::move(r);
    probe_results_.clear();
    for (v1::AccessProbeResult& r : access_results_) {
      *request->add_access_probe_results() = std::move(r);
    }
    access_results_.clear();
  }
  request->set_epoch(epoch_);
  request->set_rss_bytes(512ull << 20);
  for (const auto& [kind, seconds] : SpeedClassOf(index_).layer_seconds_per_sample) {
    (*request->mutable_layer_seconds_per_sample())[kind] = seconds;
  }
  auto response = std::make_shared<v1::HeartbeatResponse>();
  const Clock::time_point sent = Clock::now();
  ++swarm_->calls_in_flight;
  stub()->async()->Heartbeat(
      context.get(), request.get(), response.get(),
      [this, context, request, response, sent](grpc::Status status) {
        CallInFlight counted(swarm_);
        if (!status.ok()) {
          ++swarm_->heartbeat_errors;
          swarm_->errors.Add("Heartbeat", status.error_code());
          return;
        }
        swarm_->heartbeat_ms.Add(SecondsSince(sent) * 1000);
        if (!response->known()) {
          // The lease ended (or the coordinator forgot us): join again.
          ++swarm_->rejoins;
          joined_ = false;
          Join();
          return;
        }
        last_known_heartbeat_ns_ = Clock::now().time_since_epoch().count();
        // Answer the tasks as a worker in this region would.
        absl::MutexLock lock(&mu_);
        const int region = RegionOf(index_);
        for (const v1::ProbeTask& task : response->probes()) {
          v1::ProbeResult result;
          result.set_worker_id(task.worker_id());
          result.set_reachable(true);
          if (task.measure_bytes() > 0) {
            const LinkFigures link = LinkBetween(region, RegionOf(IndexOfAddress(task.address())));
            result.set_measured(true);
            result.set_rtt_s(link.rtt_s);
            result.set_rate_bps(std::min(link.rate_bps,
                                         std::min(AccessRate(index_),
                                                  AccessRate(IndexOfAddress(task.address())))));
          }
          probe_results_.push_back(std::move(result));
          ++swarm_->probes_answered;
        }
        if (response->has_access_probe() && response->access_probe().peers_size() > 0) {
          v1::AccessProbeResult access;
          access.set_measured(true);
          access.set_uplink_bps(AccessRate(index_));
          access.set_downlink_bps(AccessRate(index_));
          access.set_peers(response->access_probe().peers_size());
          access_results_.push_back(std::move(access));
          ++swarm_->probes_answered;
        }
      });
}

void FakeWorker::Silence() {
  silent_ = true;
  absl::MutexLock lock(&mu_);
  if (reader_ != nullptr) reader_->Cancel();
}

void FakeWorker::Revive() {
  silent_ = false;
  joined_ = false;
  Join();
}

void FakeWorker::Stop() {
  stopped_ = true;
  absl::MutexLock lock(&mu_);
  if (reader_ != nullptr) reader_->Cancel();
}

}  // namespace geotrain::swarm
