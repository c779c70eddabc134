// A small HTTP/1.1 server for the daemons' read-only pages (/metrics, the
// coordinator's status page): GET only, one request per connection,
// answered from handlers by path. Every port is reachable by a stranger: a request line
// and headers are bounded (2 KiB, 64 lines), a connection that does not
// send them within 2 s is closed, and only `max_connections` are served at
// once, at most `max_connections_per_source` for one source host (the rest
// are answered 503 at once).
//
// Why not prometheus-cpp's pull exposer (civetweb): in a process that loads
// Debian's LibTorch 1.13, civetweb's mg_start fails after binding ("null
// context when constructing CivetServer"; its access-control check sees a
// list that was never set), so the worker could not serve it. The metrics'
// model and text format still come from prometheus-cpp (metrics_exporter).
#ifndef GEOTRAIN_COMMON_HTTP_SERVER_H_
#define GEOTRAIN_COMMON_HTTP_SERVER_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/tcp_socket.h"

namespace geotrain {

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

struct HttpRequest {
  std::string method;  // GET or HEAD
  std::string path;    // without the query string
  std::string query;   // after '?', undecoded
  std::map<std::string, std::string> headers;  // names lower-cased, values trimmed

  // The header's value, "" when absent.
  std::string Header(const std::string& lower_case_name) const;
};

struct HttpServerOptions {
  std::string listen;  // HOST:PORT, port 0: any
  absl::Duration request_timeout = absl::Seconds(2);
  int max_connections = 2;  // served at once, each on its own thread
  // Of those, from one source host: a stranger who keeps idle connections
  // open cannot take every place (issue 32: eight did, and viewers got 2
  // of 10 requests served).
  int max_connections_per_source = 1;
};

class HttpServer {
 public:
  // Handlers run on the server's threads: they must be thread-safe. The
  // path is matched without its query string.
  using Handler = std::function<HttpResponse(const HttpRequest&)>;

  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(HttpServerOptions options,
                                                           std::map<std::string, Handler> handlers);
  ~HttpServer();  // stops accepting and waits for the threads

  int port() const { return port_; }

  // The response to one request: its request line and header lines
  // (without line ends), as read from a connection (tests, fuzzing).
  static HttpResponse Answer(const std::string& request_line,
                             const std::vector<std::string>& header_lines,
                             const std::map<std::string, Handler>& handlers);
  static HttpResponse Answer(const std::string& request_line,
                             const std::map<std::string, Handler>& handlers) {
    return Answer(request_line, {}, handlers);
  }

 private:
  HttpServer(HttpServerOptions options, std::map<std::string, Handler> handlers,
             TcpListener listener);
  void AcceptLoop();
  // Answers one request; the caller ends the connection.
  void Serve(TcpSocket& connection);

  const HttpServerOptions options_;
  const std::map<std::string, Handler> handlers_;
  TcpListener listener_;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<int> serving_{0};
  absl::Mutex sources_mu_;
  std::map<std::string, int> serving_by_source_ ABSL_GUARDED_BY(sources_mu_);
  std::thread accept_thread_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_HTTP_SERVER_H_
