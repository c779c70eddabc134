// The first message on every link, and what an end says to a relay
// before it.
#ifndef GEOTRAIN_WORKER_LINK_HELLO_H_
#define GEOTRAIN_WORKER_LINK_HELLO_H_

#include <cstdint>
#include <string>

#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

// HELLO header for worker `from_worker` on `from_stage` opening a link to
// `to_worker` (also the answer, without workers).
inline v1::LinkHeader MakeHello(uint64_t epoch, int from_stage, const std::string& from_worker = "",
                                const std::string& to_worker = "") {
  v1::LinkHeader hello;
  hello.set_kind(v1::MESSAGE_KIND_HELLO);
  hello.set_epoch(epoch);
  hello.set_from_stage(from_stage);
  hello.set_from_worker(from_worker);
  hello.set_to_worker(to_worker);
  return hello;
}

// "GTRELAY1 <rendezvous> <up|down>": what a link end says to a relay first.
inline constexpr char kRelayGreeting[] = "GTRELAY1";

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_LINK_HELLO_H_
