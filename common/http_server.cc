#include "common/http_server.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"

namespace geotrain {
namespace {

constexpr size_t kMaxLineBytes = 2048;
constexpr int kMaxHeaderLines = 64;

std::string StatusText(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 503: return "Service Unavailable";
    default: return "Error";
  }
}

HttpResponse Plain(int status, std::string body) {
  HttpResponse response;
  response.status = status;
  response.body = std::move(body);
  return response;
}

std::string Serialize(const HttpResponse& r) {
  return absl::StrCat("HTTP/1.1 ", r.status, " ", StatusText(r.status),
                      "\r\nContent-Type: ", r.content_type,
                      "\r\nContent-Length: ", r.body.size(),
                      "\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n", r.body);
}

}  // namespace

std::string HttpRequest::Header(const std::string& lower_case_name) const {
  auto it = headers.find(lower_case_name);
  return it == headers.end() ? "" : it->second;
}

HttpResponse HttpServer::Answer(const std::string& request_line,
                                const std::vector<std::string>& header_lines,
                                const std::map<std::string, Handler>& handlers) {
  std::vector<std::string> parts = absl::StrSplit(request_line, ' ');
  if (parts.size() != 3 || !absl::StartsWith(parts[2], "HTTP/1.") || parts[1].empty() ||
      parts[1][0] != '/') {
    return Plain(400, "bad request line\n");
  }
  if (parts[0] != "GET" && parts[0] != "HEAD") return Plain(405, "GET only\n");
  HttpRequest request;
  request.method = parts[0];
  const size_t query = parts[1].find('?');
  request.path = parts[1].substr(0, query);
  if (query != std::string::npos) request.query = parts[1].substr(query + 1);
  for (const std::string& line : header_lines) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos || colon == 0) return Plain(400, "bad header line\n");
    request.headers[absl::AsciiStrToLower(line.substr(0, colon))] =
        std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
  }
  const std::string& path = request.path;
  auto handler = handlers.find(path);
  if (handler == handlers.end()) {
    std::string known;
    for (const auto& [p, h] : handlers) absl::StrAppend(&known, " ", p);
    return Plain(404, absl::StrCat("no page ", path.substr(0, 128), "; pages:", known, "\n"));
  }
  HttpResponse response = handler->second(request);
  if (parts[0] == "HEAD") response.body.clear();
  return response;
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(
    HttpServerOptions options, std::map<std::string, Handler> handlers) {
  absl::StatusOr<TcpListener> listener = TcpListener::Listen(options.listen);
  if (!listener.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen, ": ",
                                               listener.status().message()));
  }
  std::unique_ptr<HttpServer> server(
      new HttpServer(std::move(options), std::move(handlers), *std::move(listener)));
  server->accept_thread_ = std::thread([s = server.get()] { s->AcceptLoop(); });
  return server;
}

HttpServer::HttpServer(HttpServerOptions options, std::map<std::string, Handler> handlers,
                       TcpListener listener)
    : options_(std::move(options)),
      handlers_(std::move(handlers)),
      listener_(std::move(listener)),
      port_(listener_.port()) {}

HttpServer::~HttpServer() {
  stopping_ = true;
  listener_.Shutdown();
  if (accept_thread_.joinable()) accept_thread_.join();
  // Each connection ends within the request timeout (reads) or its write
  // timeout.
  while (serving_ > 0) absl::SleepFor(absl::Milliseconds(10));
}

void HttpServer::AcceptLoop() {
  while (!stopping_) {
    absl::StatusOr<TcpSocket> connection = listener_.Accept();
    if (!connection.ok()) break;
    connection->SetTimeouts(options_.request_timeout, options_.request_timeout);
    // "ipv4:198.51.100.3:40112" -> its host part.
    std::string source = connection->PeerName();
    source = source.substr(0, source.rfind(':'));
    bool admitted = false;
    {
      absl::MutexLock lock(&sources_mu_);
      int& mine = serving_by_source_[source];
      if (serving_ < options_.max_connections && mine < options_.max_connections_per_source) {
        ++mine;
        ++serving_;
        admitted = true;
      } else if (mine == 0) {
        serving_by_source_.erase(source);
      }
    }
    if (!admitted) {
      const std::string busy = Serialize(Plain(503, "busy; try again\n"));
      connection->WriteAll(busy.data(), busy.size());
      continue;
    }
    std::thread([this, source, socket = *std::move(connection)]() mutable {
      Serve(socket);
      {
        // The place is free before the client sees the end of its
        // response: a request right after it finds the place again.
        absl::MutexLock lock(&sources_mu_);
        if (--serving_by_source_[source] == 0) serving_by_source_.erase(source);
        --serving_;
      }
      socket.ShutdownWrites();
    }).detach();
  }
}

void HttpServer::Serve(TcpSocket& connection) {
  const absl::Time deadline = absl::Now() + options_.request_timeout;
  absl::StatusOr<std::string> request_line = connection.ReadLine(kMaxLineBytes, deadline);
  if (!request_line.ok()) return;  // silent or too long: nothing to answer
  std::string line = *request_line;
  if (!line.empty() && line.back() == '\r') line.pop_back();
  std::vector<std::string> headers;
  for (int i = 0;; ++i) {
    absl::StatusOr<std::string> header = connection.ReadLine(kMaxLineBytes, deadline);
    if (!header.ok()) return;
    if (!header->empty() && header->back() == '\r') header->pop_back();
    if (header->empty()) break;
    if (i == kMaxHeaderLines) {
      const std::string refused = Serialize(Plain(400, "too many header lines\n"));
      connection.WriteAll(refused.data(), refused.size());
      return;
    }
    headers.push_back(*std::move(header));
  }
  const std::string response = Serialize(Answer(line, headers, handlers_));
  connection.WriteAll(response.data(), response.size());
}

}  // namespace geotrain
