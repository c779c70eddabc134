// ReplicaRouter on a fake clock with recording sinks: which worker of the
// next stage each message goes to.
#include "worker/replica_router.h"

#include <gtest/gtest.h>

#include <map>

#include <vector>

namespace geotrain {
namespace {

class RecordingSink : public MessageSink {
 public:
  absl::Status Send(LinkMessage message) override {
    if (fail) return absl::UnavailableError("broken");
    kinds.push_back(message.header.kind());
    microbatches.push_back(message.header.microbatch());
    return absl::OkStatus();
  }
  bool fail = false;
  std::vector<v1::MessageKind> kinds;
  std::vector<uint64_t> microbatches;
};

LinkMessage Message(v1::MessageKind kind, uint64_t microbatch = 0) {
  LinkMessage message;
  message.header.set_kind(kind);
  message.header.set_microbatch(microbatch);
  return message;
}

class ReplicaRouterTest : public testing::Test {
 protected:
  ReplicaRouterTest()
      : router_({{"a", "a:1", &a_}, {"b", "b:1", &b_}}, [this] { return now_; }) {}

  // Sends microbatch `id` and returns which sink got it.
  char SendActivation(uint64_t id) {
    const size_t a_before = a_.microbatches.size();
    EXPECT_TRUE(router_.Send(Message(v1::MESSAGE_KIND_ACTIVATION, id)).ok());
    return a_.microbatches.size() > a_before ? 'a' : 'b';
  }

  absl::Time now_ = absl::UnixEpoch();
  RecordingSink a_, b_;
  ReplicaRouter router_;
};

TEST_F(ReplicaRouterTest, UnmeasuredWorkersShareTheLoad) {
  EXPECT_EQ(SendActivation(0), 'a');
  EXPECT_EQ(SendActivation(1), 'b');  // a has one outstanding
}

TEST_F(ReplicaRouterTest, TheFasterWorkerGetsMoreMicrobatches) {
  // a returns each microbatch in 10 ms, b in 40 ms: in steady state a should
  // carry about 4 of every 5.
  std::map<uint64_t, absl::Time> due;
  std::map<char, int> counts;
  uint64_t next = 0;
  for (int tick = 0; tick < 4000; ++tick) {  // 1 ms ticks
    now_ += absl::Milliseconds(1);
    for (auto it = due.begin(); it != due.end();) {
      if (it->second <= now_) {
        router_.OnReply(it->first);
        it = due.erase(it);
      } else {
        ++it;
      }
    }
    while (due.size() < 6) {  // a window of 6 in flight
      const char to = SendActivation(next);
      ++counts[to];
      due[next++] = now_ + absl::Milliseconds(to == 'a' ? 10 : 40);
    }
  }
  const double share_a = static_cast<double>(counts['a']) / (counts['a'] + counts['b']);
  EXPECT_GT(share_a, 0.7) << counts['a'] << " vs " << counts['b'];
  EXPECT_GT(counts['b'], 0);  // the slower one still works
}

TEST_F(ReplicaRouterTest, APausedWorkerGetsNothingNew) {
  for (uint64_t id = 0; id < 20; id += 2) {  // both measured at 10 ms
    SendActivation(id);
    SendActivation(id + 1);
    now_ += absl::Milliseconds(10);
    router_.OnReply(id);
    router_.OnReply(id + 1);
  }
  // One microbatch each; b stops answering.
  const char first = SendActivation(100);
  const char second = SendActivation(101);
  ASSERT_NE(first, second);
  now_ += absl::Milliseconds(10);
  router_.OnReply(first == 'a' ? 100 : 101);
  for (uint64_t id = 200; id < 260; ++id) {
    EXPECT_EQ(SendActivation(id), 'a') << id;
    now_ += absl::Milliseconds(10);
    router_.OnReply(id);
  }
  const std::vector<v1::RouteStats> stats = router_.Stats();
  EXPECT_EQ(stats[1].outstanding(), 1);
  EXPECT_GT(stats[1].oldest_outstanding_s(), 0.5);
  EXPECT_EQ(stats[0].outstanding(), 0);
}

TEST_F(ReplicaRouterTest, AWorkerOnceSlowIsTriedAgain) {
  SendActivation(0);
  SendActivation(1);  // b
  now_ += absl::Milliseconds(10);
  router_.OnReply(0);        // a answers in 10 ms ...
  now_ += absl::Seconds(3);  // ... b after a 3 s pause
  router_.OnReply(1);
  for (uint64_t id = 2; id < 3000; ++id) {  // a keeps answering in 10 ms
    if (SendActivation(id) == 'b') {
      // Tried again once its figure faded, and not before about 10 s
      // (3 s x exp(-t / 2 s) falls to a's 10 ms at t = 11.4 s).
      EXPECT_GT(id, 800u);
      return;
    }
    now_ += absl::Milliseconds(10);
    router_.OnReply(id);
  }
  ADD_FAILURE() << "b never got a microbatch again";
}

TEST_F(ReplicaRouterTest, AnEvaluationPassFollowsOnePath) {
  SendActivation(0);  // a is busier
  ASSERT_TRUE(router_.Send(Message(v1::MESSAGE_KIND_EVAL)).ok());
  router_.OnReply(0);  // a is free again: the pass still stays on b
  ASSERT_TRUE(router_.Send(Message(v1::MESSAGE_KIND_EVAL)).ok());
  ASSERT_TRUE(router_.Send(Message(v1::MESSAGE_KIND_EVAL_END)).ok());
  EXPECT_EQ(b_.kinds, (std::vector<v1::MessageKind>{v1::MESSAGE_KIND_EVAL,
                                                     v1::MESSAGE_KIND_EVAL,
                                                     v1::MESSAGE_KIND_EVAL_END}));
}

TEST_F(ReplicaRouterTest, DoneGoesToEveryWorker) {
  ASSERT_TRUE(router_.Send(Message(v1::MESSAGE_KIND_DONE)).ok());
  EXPECT_EQ(a_.kinds, std::vector<v1::MessageKind>{v1::MESSAGE_KIND_DONE});
  EXPECT_EQ(b_.kinds, std::vector<v1::MessageKind>{v1::MESSAGE_KIND_DONE});
}

// A replica may see none of the last ids (the router sent a run of them to
// the other): each DONE names the end of what its own route carried, which
// is what the replica must have finished.
TEST_F(ReplicaRouterTest, EachDoneNamesTheEndOfWhatItsRouteCarried) {
  std::map<char, uint64_t> end;
  for (uint64_t id = 0; id < 12; ++id) {
    const char to = SendActivation(id);
    end[to] = id + 1;
    if (to == 'a') router_.OnReply(id);  // a keeps up; b never replies
  }
  ASSERT_TRUE(router_.Send(Message(v1::MESSAGE_KIND_DONE)).ok());
  EXPECT_EQ(a_.kinds.back(), v1::MESSAGE_KIND_DONE);
  EXPECT_EQ(a_.microbatches.back(), end['a']);
  EXPECT_EQ(b_.microbatches.back(), end['b']);
  EXPECT_NE(end['a'], end['b']);
}

TEST_F(ReplicaRouterTest, AFailedSendNamesItsPeerAndUnknownRepliesAreIgnored) {
  router_.OnReply(12345);  // never sent: no effect
  a_.fail = true;
  EXPECT_FALSE(router_.Send(Message(v1::MESSAGE_KIND_ACTIVATION, 0)).ok());
  EXPECT_EQ(router_.failed_peer(), "a");
  EXPECT_FALSE(router_.Send(Message(v1::MESSAGE_KIND_GRADIENT, 1)).ok());
}

}  // namespace
}  // namespace geotrain
