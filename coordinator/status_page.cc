#include "coordinator/status_page.h"

#include <google/protobuf/util/json_util.h>

#include <cmath>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/metrics_exporter.h"
#include "coordinator/cluster_metrics.h"

namespace geotrain {
namespace {

// A JSON number (JSON has no NaN or infinity).
std::string Number(double value) {
  return std::isfinite(value) ? absl::StrFormat("%.8g", value) : "0";
}

HttpResponse Text(int status, std::string body) {
  HttpResponse response;
  response.status = status;
  response.body = std::move(body);
  return response;
}

// OK, or the refusal to send when the request carries no valid viewer token.
std::optional<HttpResponse> Refusal(const AccessStore* access, const HttpRequest& request) {
  if (access == nullptr) return std::nullopt;
  const std::string authorization = request.Header("authorization");
  constexpr absl::string_view kBearer = "Bearer ";  // the scheme's case is free
  if (!absl::StartsWithIgnoreCase(authorization, kBearer)) {
    return Text(401,
                "this coordinator needs a viewer token: open the page as "
                "http://HOST:PORT/#token=<viewer token> (make one with geotrain-ctl token "
                "create --role=viewer), or send \"Authorization: Bearer <viewer token>\"\n");
  }
  absl::StatusOr<std::string> checked = access->CheckToken(
      authorization.substr(kBearer.size()), v1::TOKEN_ROLE_VIEWER);
  if (!checked.ok()) {
    // One answer for every reason: a stranger learns nothing of which
    // token ids exist, their roles or their expiry (and nothing is logged,
    // so refusals cannot flood the log).
    return Text(403,
                "viewer token refused (unknown, expired, revoked, or not a viewer token)\n");
  }
  return std::nullopt;
}

// A query string's component, %XX and '+' decoded; nullopt for a bad escape.
std::optional<std::string> Unescape(absl::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '+') {
      out.push_back(' ');
    } else if (text[i] != '%') {
      out.push_back(text[i]);
    } else {
      int byte = 0;
      if (i + 2 >= text.size()) return std::nullopt;
      const absl::string_view hex = text.substr(i + 1, 2);
      if (hex.find_first_not_of("0123456789abcdefABCDEF") != absl::string_view::npos ||
          !absl::SimpleHexAtoi(hex, &byte)) {
        return std::nullopt;
      }
      out.push_back(static_cast<char>(byte));
      i += 2;
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<v1::ClusterStatusRequest> StatusRequestOfQuery(const std::string& query) {
  v1::ClusterStatusRequest request;
  if (query.size() > 1024) return absl::InvalidArgumentError("status.json: a query of over 1 KiB");
  for (absl::string_view part : absl::StrSplit(query, '&', absl::SkipEmpty())) {
    const size_t equals = part.find('=');
    const std::string key(part.substr(0, equals));
    std::optional<std::string> value =
        Unescape(equals == absl::string_view::npos ? "" : part.substr(equals + 1));
    if (!value.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("status.json: ", key, ": a bad %-escape"));
    }
    auto number = [&](int most) -> absl::StatusOr<int> {
      int n = 0;
      if (!absl::SimpleAtoi(*value, &n) || n < 0 || n > most) {
        return absl::InvalidArgumentError(
            absl::StrCat("status.json: ", key, " must be a number of 0 to ", most));
      }
      return n;
    };
    if (key == "page_size") {
      absl::StatusOr<int> n = number(100000);
      if (!n.ok()) return n.status();
      request.set_page_size(*n);
    } else if (key == "page_token") {
      request.set_page_token(*value);
    } else if (key == "name") {
      if (value->size() > 128) return absl::InvalidArgumentError("status.json: name over 128 bytes");
      request.mutable_filter()->set_name_contains(*value);
    } else if (key == "state") {
      request.mutable_filter()->set_state(*value);
    } else if (key == "stage" || key == "pipeline") {
      absl::StatusOr<int> n = number(100000);
      if (!n.ok()) return n.status();
      if (key == "stage") {
        request.mutable_filter()->set_stage(*n);
      } else {
        request.mutable_filter()->set_pipeline(*n);
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "status.json: unknown parameter '", key.substr(0, 32),
          "' (page_size, page_token, name, state, stage, pipeline)"));
    }
  }
  return request;
}

std::string StatusJson(const v1::ClusterStatus& status, const ProgressHistory& history,
                       bool serving) {
  std::string status_json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  if (!google::protobuf::util::MessageToJsonString(status, &status_json, options).ok()) {
    status_json = "{}";
  }
  std::string json = absl::StrCat("{\"status\":", status_json, ",\"history\":{\"steps\":[");
  bool first = true;
  for (const StepPoint& p : history.steps()) {
    absl::StrAppend(&json, first ? "" : ",", "{\"step\":", p.step, ",\"loss\":", Number(p.loss),
                    ",\"samples_per_s\":", Number(p.samples_per_s),
                    ",\"time_s\":", Number(p.time_s), "}");
    first = false;
  }
  absl::StrAppend(&json, "],\"evals\":[");
  first = true;
  for (const EvalPoint& p : history.evals()) {
    absl::StrAppend(&json, first ? "" : ",", "{\"step\":", p.step,
                    ",\"val_loss\":", Number(p.val_loss));
    if (p.has_accuracy) absl::StrAppend(&json, ",\"accuracy\":", Number(p.accuracy));
    absl::StrAppend(&json, ",\"time_s\":", Number(p.time_s), "}");
    first = false;
  }
  absl::StrAppend(&json, "]},\"health\":{\"coordinator\":\"",
                  serving ? "SERVING" : "NOT_SERVING", "\"}}");
  return json;
}

std::map<std::string, HttpServer::Handler> StatusPageHandlers(const StatusPageOptions& options) {
  std::map<std::string, HttpServer::Handler> pages;
  pages["/"] = [](const HttpRequest&) {
    HttpResponse page;
    page.content_type = "text/html; charset=utf-8";
    page.body = kStatusPageHtml;
    return page;
  };
  JobController* controller = options.controller;
  const AccessStore* access = options.access;
  std::function<bool()> serving = options.serving;
  const std::string security = options.security;
  pages["/status.json"] = [controller, access, serving, security](const HttpRequest& request) {
    if (std::optional<HttpResponse> refused = Refusal(access, request)) return *refused;
    absl::StatusOr<v1::ClusterStatusRequest> asked = StatusRequestOfQuery(request.query);
    if (!asked.ok()) return Text(400, absl::StrCat(asked.status().message(), "\n"));
    absl::StatusOr<v1::ClusterStatus> assembled = controller->Status(*asked);
    if (!assembled.ok()) return Text(400, absl::StrCat(assembled.status().message(), "\n"));
    HttpResponse response;
    response.content_type = "application/json";
    v1::ClusterStatus status = *std::move(assembled);
    status.set_security(security);
    response.body = StatusJson(status, controller->History(), serving ? serving() : true);
    return response;
  };
  pages["/metrics"] = [controller, access](const HttpRequest& request) {
    if (std::optional<HttpResponse> refused = Refusal(access, request)) return *refused;
    HttpResponse response;
    response.content_type = "text/plain; version=0.0.4; charset=utf-8";
    response.body = ExpositionText(ClusterMetrics(controller->Status()).Take());
    return response;
  };
  return pages;
}

absl::StatusOr<std::unique_ptr<HttpServer>> StartStatusPage(const StatusPageOptions& options) {
  HttpServerOptions server;
  server.listen = options.listen;
  server.max_connections = options.max_connections;
  server.max_connections_per_source = options.max_connections_per_source;
  return HttpServer::Start(server, StatusPageHandlers(options));
}

}  // namespace geotrain
