#include "common/fair_queue.h"

#include <deque>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace fuyou {
namespace {

constexpr uint64_t kQuantum = 1000;

struct Item {
  uint64_t user;
  uint64_t flow;
  int seq;
  uint64_t cost;
};

// Pushes `count` items of `cost` for (user, flow), numbered from the flow's next seq.
void Fill(FairQueue<Item>& queue, std::map<std::pair<uint64_t, uint64_t>, int>& seqs, FairKey key, int count,
          uint64_t cost) {
  for (int i = 0; i < count; ++i) {
    queue.PushBack(key, cost, Item{key.user, key.flow, seqs[{key.user, key.flow}]++, cost});
  }
}

std::vector<Item> Drain(FairQueue<Item>& queue) {
  std::vector<Item> order;
  while (!queue.empty()) order.push_back(queue.PopNext());
  return order;
}

TEST(FairQueueTest, StartsEmpty) {
  FairQueue<int> queue(kQuantum);
  EXPECT_TRUE(queue.empty());
  EXPECT_EQ(queue.size(), 0u);
  EXPECT_EQ(queue.users(), 0u);
  EXPECT_EQ(queue.waiting(FairKey{1, 1}), 0u);
}

// One flow alone is served exactly as a std::deque fed the same calls.
TEST(FairQueueTest, OneFlowIsADeque) {
  std::mt19937 random(7);
  FairQueue<int> queue(kQuantum);
  std::deque<int> reference;
  const FairKey key{3, 9};
  for (int i = 0; i < 2000; ++i) {
    const unsigned what = random() % 3;
    const uint64_t cost = random() % (3 * kQuantum);
    if (what == 0 && !reference.empty()) {
      ASSERT_EQ(queue.PopNext(), reference.front());
      reference.pop_front();
    } else if (what == 1) {
      queue.PushFront(key, cost, i);
      reference.push_front(i);
    } else {
      queue.PushBack(key, cost, i);
      reference.push_back(i);
    }
    ASSERT_EQ(queue.size(), reference.size());
  }
  while (!reference.empty()) {
    ASSERT_EQ(queue.PopNext(), reference.front());
    reference.pop_front();
  }
  EXPECT_TRUE(queue.empty());
}

// The finding of issue 32: a hog's many big items, queued first from several
// sessions, do not starve a small user's item (a FIFO would serve all 300 first).
TEST(FairQueueTest, AHogsBigItemsDoNotStarveASmallUser) {
  FairQueue<Item> queue(kQuantum);
  std::map<std::pair<uint64_t, uint64_t>, int> seqs;
  for (uint64_t session = 1; session <= 3; ++session) Fill(queue, seqs, FairKey{65534, session}, 100, kQuantum);
  Fill(queue, seqs, FairKey{0, 99}, 1, kQuantum / 16);
  EXPECT_EQ(queue.users(), 2u);
  const Item first = queue.PopNext();
  EXPECT_EQ(first.user, 65534u);
  const Item second = queue.PopNext();
  EXPECT_EQ(second.user, 0u) << "the small user's item waits for at most one quantum of the hog's";
  EXPECT_EQ(queue.users(), 1u);
}

// Within a flow the order is its FIFO, however the flows interleave.
TEST(FairQueueTest, OrderWithinAFlowIsKept) {
  std::mt19937 random(11);
  FairQueue<Item> queue(kQuantum);
  std::map<std::pair<uint64_t, uint64_t>, int> seqs;
  for (int i = 0; i < 3000; ++i) {
    const FairKey key{random() % 3, random() % 4};
    Fill(queue, seqs, key, 1, random() % (2 * kQuantum));
  }
  std::map<std::pair<uint64_t, uint64_t>, int> next;
  for (const Item& item : Drain(queue)) {
    ASSERT_EQ(item.seq, (next[{item.user, item.flow}]++)) << "user " << item.user << " flow " << item.flow;
  }
}

// Users share by bytes, not by items: a user of big items and one of small
// items, both always backlogged, are served the same bytes (within a quantum
// or so), and a user's share does not grow with its sessions.
TEST(FairQueueTest, UsersShareByBytesWhateverTheirItemSizesAndSessions) {
  FairQueue<Item> queue(kQuantum);
  std::map<std::pair<uint64_t, uint64_t>, int> seqs;
  for (uint64_t session = 1; session <= 4; ++session) Fill(queue, seqs, FairKey{1, session}, 400, kQuantum);
  Fill(queue, seqs, FairKey{2, 1}, 4000, kQuantum / 8);
  std::map<uint64_t, uint64_t> bytes;
  for (int i = 0; i < 2000; ++i) {
    const Item item = queue.PopNext();
    bytes[item.user] += item.cost;
  }
  const double ratio = static_cast<double>(bytes[1]) / static_cast<double>(bytes[2]);
  EXPECT_NEAR(ratio, 1.0, 0.02) << bytes[1] << " bytes against " << bytes[2];
}

// Items dearer than a quantum wait for their user's credit to build up over
// rounds, and the shares stay by bytes.
TEST(FairQueueTest, ItemsDearerThanAQuantumAreServedByBytesToo) {
  FairQueue<Item> queue(kQuantum);
  std::map<std::pair<uint64_t, uint64_t>, int> seqs;
  Fill(queue, seqs, FairKey{1, 1}, 100, 10 * kQuantum);
  Fill(queue, seqs, FairKey{2, 1}, 1000, kQuantum);
  std::map<uint64_t, uint64_t> bytes;
  uint64_t run_of_small = 0;
  for (int i = 0; i < 550; ++i) {
    const Item item = queue.PopNext();
    bytes[item.user] += item.cost;
    run_of_small = item.user == 2 ? run_of_small + 1 : 0;
    EXPECT_LE(run_of_small, 10u);
  }
  const double ratio = static_cast<double>(bytes[1]) / static_cast<double>(bytes[2]);
  EXPECT_NEAR(ratio, 1.0, 0.05) << bytes[1] << " bytes against " << bytes[2];
}

// A flow of weight 1 (background: a job copy) gets a quarter of the bytes of
// a foreground flow, in its own user and against another user.
TEST(FairQueueTest, ABackgroundFlowGetsItsWeightsShare) {
  for (const bool same_user : {true, false}) {
    FairQueue<Item> queue(kQuantum);
    std::map<std::pair<uint64_t, uint64_t>, int> seqs;
    Fill(queue, seqs, FairKey{1, 1, /*weight=*/1}, 2000, kQuantum / 4);
    Fill(queue, seqs, FairKey{same_user ? 1u : 2u, 2, kForegroundWeight}, 2000, kQuantum / 4);
    std::map<uint64_t, uint64_t> bytes;  // by flow
    for (int i = 0; i < 1000; ++i) {
      const Item item = queue.PopNext();
      bytes[item.flow] += item.cost;
    }
    const double ratio = static_cast<double>(bytes[2]) / static_cast<double>(bytes[1]);
    EXPECT_NEAR(ratio, 4.0, 0.2) << (same_user ? "same user" : "two users");
  }
}

// PushFront: an item continuing started work goes ahead of its flow's, and a
// flow (user) with nothing waiting takes the next turn.
TEST(FairQueueTest, PushFrontTakesTheNextTurn) {
  FairQueue<std::string> queue(kQuantum);
  for (int i = 0; i < 3; ++i) queue.PushBack(FairKey{1, 1}, kQuantum, "a" + std::to_string(i));
  queue.PushBack(FairKey{2, 1}, kQuantum, "b0");
  EXPECT_EQ(queue.PopNext(), "a0");
  queue.PushFront(FairKey{3, 1}, kQuantum, "c-continued");
  queue.PushFront(FairKey{1, 1}, kQuantum, "a-continued");
  EXPECT_EQ(queue.PopNext(), "c-continued");
  std::vector<std::string> rest;
  while (!queue.empty()) rest.push_back(queue.PopNext());
  EXPECT_EQ(rest, (std::vector<std::string>{"b0", "a-continued", "a1", "a2"}));
}

// Costs of 0 (a sync, a no-op) are served in turn like any other.
TEST(FairQueueTest, ZeroCostItemsAreServed) {
  FairQueue<int> queue(kQuantum);
  for (int i = 0; i < 5; ++i) queue.PushBack(FairKey{1, 1}, 0, i);
  queue.PushBack(FairKey{2, 1}, 0, 100);
  std::vector<int> order;
  while (!queue.empty()) order.push_back(queue.PopNext());
  EXPECT_EQ(order.size(), 6u);
}

}  // namespace
}  // namespace fuyou
