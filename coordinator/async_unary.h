// One unary method served on gRPC's asynchronous API, from a completion
// queue of its own by a few threads of its own. Its calls never wait for,
// nor take, one of the synchronous server's handler threads: joins,
// enrollments and checkpoint streams can use all of those up (the
// coordinator caps them at kCoordinatorMaxThreads and answers
// RESOURCE_EXHAUSTED past that), and a heartbeat refused then is a lease
// closer to its end. For methods whose handler is short and never waits on
// I/O or the network: Heartbeat.
//
// Not the callback API, for the reason plan_streams.h gives.
//
// Use: Attach before the server is built, Start after, Stop after the
// server's Shutdown. Thread-safe.
#ifndef GEOTRAIN_COORDINATOR_ASYNC_UNARY_H_
#define GEOTRAIN_COORDINATOR_ASYNC_UNARY_H_

#include <functional>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/async_unary_call.h>

#include "absl/synchronization/mutex.h"

namespace geotrain {

template <typename Request, typename Response>
class AsyncUnaryMethod {
 public:
  // The method's handler, as a synchronous one would be.
  using HandleFn =
      std::function<grpc::Status(grpc::ServerContext* context, const Request& request,
                                 Response* response)>;
  // The service's Request<Method> (WithAsyncMethod_<Method>).
  using RequestFn = std::function<void(grpc::ServerContext* context, Request* request,
                                       grpc::ServerAsyncResponseWriter<Response>* responder,
                                       grpc::ServerCompletionQueue* queue, void* tag)>;

  AsyncUnaryMethod(int threads, HandleFn handle)
      : threads_(std::max(1, threads)), handle_(std::move(handle)) {}
  ~AsyncUnaryMethod() { Stop(); }
  AsyncUnaryMethod(const AsyncUnaryMethod&) = delete;
  AsyncUnaryMethod& operator=(const AsyncUnaryMethod&) = delete;

  void Attach(grpc::ServerBuilder* builder) { queue_ = builder->AddCompletionQueue(); }

  // One call waits per thread, so a burst finds each thread a call ready.
  void Start(RequestFn request) {
    request_ = std::move(request);
    for (int i = 0; i < threads_; ++i) Accept();
    for (int i = 0; i < threads_; ++i) {
      workers_.emplace_back([this] {
        void* tag = nullptr;
        bool ok = false;
        while (queue_->Next(&tag, &ok)) Handle(static_cast<Call*>(tag), ok);
      });
    }
  }

  // Drains the queue and joins the threads. REQUIRES: the server is shut
  // down (no call arrives any more).
  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      if (stopped_ || queue_ == nullptr) return;
      stopped_ = true;
      queue_->Shutdown();  // no Accept after this: it checks stopped_
    }
    for (std::thread& worker : workers_) worker.join();
    workers_.clear();
  }

 private:
  struct Call {
    grpc::ServerContext context;
    Request request;
    Response response;
    grpc::ServerAsyncResponseWriter<Response> responder{&context};
    bool answered = false;
  };

  void Accept() {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    auto* call = new Call;
    request_(&call->context, &call->request, &call->responder, queue_.get(), call);
  }

  void Handle(Call* call, bool ok) {
    // The answer is out (or the call was cancelled), or the server is
    // shutting down and this call never started.
    if (call->answered || !ok) {
      delete call;
      return;
    }
    Accept();  // the next call
    const grpc::Status status = handle_(&call->context, call->request, &call->response);
    call->answered = true;
    call->responder.Finish(call->response, status, call);
  }

  const int threads_;
  const HandleFn handle_;
  RequestFn request_;
  std::unique_ptr<grpc::ServerCompletionQueue> queue_;
  std::vector<std::thread> workers_;
  absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_ASYNC_UNARY_H_
