#include "common/http_server.h"

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace geotrain {
namespace {

std::map<std::string, HttpServer::Handler> Pages() {
  return {{"/metrics",
           [](const HttpRequest&) {
             HttpResponse r;
             r.body = "geotrain_job_step 7\n";
             return r;
           }},
          {"/echo", [](const HttpRequest& request) {
             HttpResponse r;
             r.body = request.method + " " + request.path + " ?" + request.query + " auth=" +
                      request.Header("authorization") + " host=" + request.Header("host");
             return r;
           }}};
}

TEST(HttpServerTest, AnswersGetAndHeadOnKnownPathsOnly) {
  EXPECT_EQ(HttpServer::Answer("GET /metrics HTTP/1.1", Pages()).body, "geotrain_job_step 7\n");
  EXPECT_EQ(HttpServer::Answer("GET /metrics?x=1 HTTP/1.0", Pages()).status, 200);
  const HttpResponse head = HttpServer::Answer("HEAD /metrics HTTP/1.1", Pages());
  EXPECT_EQ(head.status, 200);
  EXPECT_TRUE(head.body.empty());
  EXPECT_EQ(HttpServer::Answer("GET /other HTTP/1.1", Pages()).status, 404);
  EXPECT_TRUE(absl::StrContains(HttpServer::Answer("GET /x HTTP/1.1", Pages()).body, "/metrics"));
  EXPECT_EQ(HttpServer::Answer("POST /metrics HTTP/1.1", Pages()).status, 405);
  for (const char* bad : {"", "GET", "GET /metrics", "GET metrics HTTP/1.1",
                          "GET /metrics SPDY/3", "GET  /metrics HTTP/1.1"}) {
    EXPECT_EQ(HttpServer::Answer(bad, Pages()).status, 400) << bad;
  }
}

std::string Fetch(int port, const std::string& request) {
  absl::StatusOr<TcpSocket> socket =
      TcpSocket::Connect("127.0.0.1:" + std::to_string(port), absl::Seconds(2));
  EXPECT_TRUE(socket.ok()) << socket.status();
  if (!socket.ok()) return "";
  socket->SetTimeouts(absl::Seconds(5), absl::Seconds(5));
  if (!request.empty()) socket->WriteAll(request.data(), request.size());
  std::string reply;
  char buffer[4096];
  long got;
  while ((got = socket->ReadSome(buffer, sizeof(buffer))) > 0) reply.append(buffer, got);
  return reply;
}

TEST(HttpServerTest, HandlersSeeTheQueryAndTheHeaders) {
  EXPECT_EQ(HttpServer::Answer("GET /echo?a=1&b HTTP/1.1",
                               {"Host: example", "AUTHORIZATION:   Bearer x.y  "}, Pages())
                .body,
            "GET /echo ?a=1&b auth=Bearer x.y host=example");
  EXPECT_EQ(HttpServer::Answer("GET /echo HTTP/1.1", {"no colon here"}, Pages()).status, 400);
  EXPECT_EQ(HttpServer::Answer("GET /echo HTTP/1.1", {": no name"}, Pages()).status, 400);
}

TEST(HttpServerTest, ServesOverTcpAndClosesSilentOrOversizedRequests) {
  HttpServerOptions options;
  options.listen = "127.0.0.1:0";
  options.request_timeout = absl::Milliseconds(300);
  absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Start(options, Pages());
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  const std::string ok = Fetch(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_TRUE(absl::StartsWith(ok, "HTTP/1.1 200 OK\r\n")) << ok;
  EXPECT_TRUE(absl::StrContains(ok, "Content-Length: 20\r\n")) << ok;
  EXPECT_TRUE(absl::EndsWith(ok, "\r\n\r\ngeotrain_job_step 7\n")) << ok;
  EXPECT_TRUE(absl::StartsWith(Fetch(port, "GET /nope HTTP/1.1\r\n\r\n"), "HTTP/1.1 404"));
  // A stranger who sends nothing, or a line past 2 KiB, is cut off without
  // an answer once the request timeout passes.
  const absl::Time start = absl::Now();
  EXPECT_EQ(Fetch(port, ""), "");
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_EQ(Fetch(port, std::string(4096, 'A')), "");
  // The server still answers afterwards.
  EXPECT_TRUE(absl::StartsWith(Fetch(port, "GET /metrics HTTP/1.0\r\n\r\n"), "HTTP/1.1 200"));
}

// Issue 32: eight idle connections, reopened as they timed out, denied the
// page to everyone else.
TEST(HttpServerTest, IdleConnectionsFromOneHostTakeOnlyItsOwnPlaces) {
  HttpServerOptions options;
  options.listen = "127.0.0.1:0";
  options.request_timeout = absl::Seconds(5);
  options.max_connections = 4;
  options.max_connections_per_source = 2;
  absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Start(options, Pages());
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = absl::StrCat("127.0.0.1:", (*server)->port());
  // 127.0.0.1 holds its two places with connections that send nothing...
  std::vector<TcpSocket> idle;
  for (int i = 0; i < 2; ++i) {
    idle.push_back(*TcpSocket::Connect(address, absl::Seconds(2)));
  }
  absl::SleepFor(absl::Milliseconds(200));  // accepted and being served
  // ...so a third from it is turned away at once,
  const std::string busy = Fetch((*server)->port(), "GET /metrics HTTP/1.0\r\n\r\n");
  EXPECT_TRUE(absl::StartsWith(busy, "HTTP/1.1 503")) << busy;
  // while a viewer from another host (127.0.0.2, loopback too) is served.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in from{};
  from.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.2", &from.sin_addr);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof(from)), 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>((*server)->port()));
  inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0);
  TcpSocket viewer(fd);
  viewer.SetTimeouts(absl::Seconds(5), absl::Seconds(5));
  const std::string request = "GET /metrics HTTP/1.0\r\n\r\n";
  ASSERT_TRUE(viewer.WriteAll(request.data(), request.size()));
  std::string reply;
  char buffer[4096];
  long got;
  while ((got = viewer.ReadSome(buffer, sizeof(buffer))) > 0) reply.append(buffer, got);
  EXPECT_TRUE(absl::StartsWith(reply, "HTTP/1.1 200")) << reply;
}

TEST(HttpServerTest, RefusesAnAddressItCannotListenOn) {
  HttpServerOptions options;
  options.listen = "203.0.113.1:0";  // TEST-NET-3: not an address of this host
  absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Start(options, Pages());
  ASSERT_FALSE(server.ok());
  EXPECT_TRUE(absl::StrContains(server.status().message(), "cannot listen on 203.0.113.1:0"))
      << server.status();
}

}  // namespace
}  // namespace geotrain
