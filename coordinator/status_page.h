// The coordinator's HTTP face (`--http_listen`): the live status page at /
// (coordinator/status_page.html, self-contained, compiled in), the JSON it
// polls at /status.json, and Prometheus /metrics (the same as
// --metrics_listen serves), on one bounded HttpServer.
//
// /status.json is {"status": ClusterStatus as proto3 JSON (field names as in
// status.proto), "history": {"steps": [{step, loss, samples_per_s, time_s}],
// "evals": [{step, val_loss, accuracy, time_s}]}, "health": {"coordinator":
// "SERVING" | "NOT_SERVING"}}.
//
// /status.json takes a ClusterStatusRequest in its query string, so a page
// of a thousand members stays small: page_size (0 or absent: every member,
// with the link matrix), page_token, and the filters name (in the name or
// id), state, stage and pipeline, e.g. ?page_size=50&stage=2&name=gpu.
// A malformed query is answered 400 with what was wrong.
//
// With TLS on (an AccessStore is given) every page but / needs a viewer
// token, "Authorization: Bearer <token>" (the page takes it from its URL's
// #token=...): 401 without one, 403 for one that is not a valid viewer
// token. The server speaks plain HTTP: the token crosses the network in the
// clear unless the port is private or behind a TLS-terminating proxy.
#ifndef GEOTRAIN_COORDINATOR_STATUS_PAGE_H_
#define GEOTRAIN_COORDINATOR_STATUS_PAGE_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/http_server.h"
#include "coordinator/access_store.h"
#include "coordinator/job_controller.h"
#include "coordinator/progress_history.h"
#include "geotrain/v1/status.pb.h"

namespace geotrain {

extern const char kStatusPageHtml[];

struct StatusPageOptions {
  std::string listen;  // HOST:PORT, port 0: any
  JobController* controller = nullptr;
  // Null: no token is asked for (--insecure).
  const AccessStore* access = nullptr;
  // ClusterStatus.security as the gRPC status API reports it.
  std::string security;
  // Whether the coordinator's gRPC health status is SERVING.
  std::function<bool()> serving;
  int max_connections = 16;  // browsers and scrapers, each host at most
  int max_connections_per_source = 4;  // a browser's parallel requests
};

// The body of /status.json.
std::string StatusJson(const v1::ClusterStatus& status, const ProgressHistory& history,
                       bool serving);

// The ClusterStatusRequest of a /status.json query string (undecoded, as
// HttpRequest.query holds it). INVALID_ARGUMENT naming the parameter for
// an unknown one, a number out of range, or a bad escape.
absl::StatusOr<v1::ClusterStatusRequest> StatusRequestOfQuery(const std::string& query);

// The handlers by path (tests call them without a socket).
std::map<std::string, HttpServer::Handler> StatusPageHandlers(const StatusPageOptions& options);

// Serves StatusPageHandlers. UNAVAILABLE when it cannot listen.
absl::StatusOr<std::unique_ptr<HttpServer>> StartStatusPage(const StatusPageOptions& options);

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_STATUS_PAGE_H_
