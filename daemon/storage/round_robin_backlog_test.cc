#include "storage/round_robin_backlog.h"

#include <deque>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace fuyou::storage::internal {
namespace {

// Pops everything, in the backlog's order.
template <typename T>
std::vector<T> Drain(RoundRobinBacklog<T>& backlog) {
  std::vector<T> order;
  while (!backlog.empty()) order.push_back(backlog.PopNext());
  return order;
}

TEST(RoundRobinBacklogTest, StartsEmpty) {
  RoundRobinBacklog<int> backlog;
  EXPECT_TRUE(backlog.empty());
  EXPECT_EQ(backlog.size(), 0u);
  EXPECT_EQ(backlog.owners(), 0u);
  EXPECT_EQ(backlog.waiting(IoOwner::Next()), 0u);
}

TEST(RoundRobinBacklogTest, OwnersTakeTurnsOneItemEach) {
  const IoOwner a = IoOwner::Next();
  const IoOwner b = IoOwner::Next();
  const IoOwner c = IoOwner::Next();
  RoundRobinBacklog<std::string> backlog;
  for (int i = 0; i < 4; ++i) backlog.PushBack(a, "a" + std::to_string(i));
  backlog.PushBack(b, "b0");
  backlog.PushBack(c, "c0");
  backlog.PushBack(c, "c1");
  EXPECT_EQ(backlog.size(), 7u);
  EXPECT_EQ(backlog.owners(), 3u);
  EXPECT_EQ(backlog.waiting(a), 4u);
  EXPECT_EQ(Drain(backlog), (std::vector<std::string>{"a0", "b0", "c0", "a1", "c1", "a2", "a3"}));
  EXPECT_EQ(backlog.owners(), 0u);
}

// What a plain FIFO would get wrong: an owner that queues one item behind
// another owner's flood is served after at most one of the flood's items.
TEST(RoundRobinBacklogTest, AnOwnerArrivingBehindAFloodIsServedWithinOneTurn) {
  const IoOwner flood = IoOwner::Next();
  const IoOwner reader = IoOwner::Next();
  RoundRobinBacklog<int> backlog;
  for (int i = 0; i < 100; ++i) backlog.PushBack(flood, i);
  backlog.PushBack(reader, -1);
  EXPECT_EQ(backlog.PopNext(), 0);
  EXPECT_EQ(backlog.PopNext(), -1);
  EXPECT_EQ(backlog.waiting(reader), 0u);
  EXPECT_EQ(backlog.owners(), 1u);
}

// An owner that empties leaves the turn; when it comes back it waits behind
// the owners waiting then.
TEST(RoundRobinBacklogTest, AnOwnerThatComesBackJoinsAtTheEnd) {
  const IoOwner a = IoOwner::Next();
  const IoOwner b = IoOwner::Next();
  RoundRobinBacklog<std::string> backlog;
  backlog.PushBack(a, "a0");
  backlog.PushBack(b, "b0");
  backlog.PushBack(b, "b1");
  EXPECT_EQ(backlog.PopNext(), "a0");  // a leaves the turn
  backlog.PushBack(a, "a1");
  EXPECT_EQ(Drain(backlog), (std::vector<std::string>{"b0", "a1", "b1"}));
}

// A continuation goes ahead of its own owner's items, and an owner with
// nothing else waiting takes the next turn, as the old FIFO's push_front did.
TEST(RoundRobinBacklogTest, PushFrontGoesFirstWithinItsOwner) {
  const IoOwner a = IoOwner::Next();
  const IoOwner b = IoOwner::Next();
  RoundRobinBacklog<std::string> backlog;
  backlog.PushBack(a, "a0");
  backlog.PushBack(b, "b0");
  backlog.PushFront(a, "a-cont");  // a waits: its place in the turn stays
  backlog.PushFront(IoOwner(), "d-cont");  // nothing waiting: next turn
  EXPECT_EQ(Drain(backlog), (std::vector<std::string>{"d-cont", "a-cont", "b0", "a0"}));
}

// One owner alone: the order is exactly a std::deque's fed the same calls.
TEST(RoundRobinBacklogTest, OneOwnerAloneIsOneFifo) {
  const IoOwner only = IoOwner::Next();
  RoundRobinBacklog<int> backlog;
  std::deque<int> fifo;
  std::mt19937 random(24);
  std::vector<int> popped;
  std::vector<int> expected;
  for (int i = 0; i < 1000; ++i) {
    switch (random() % 3) {
      case 0:
        backlog.PushBack(only, i);
        fifo.push_back(i);
        break;
      case 1:
        backlog.PushFront(only, i);
        fifo.push_front(i);
        break;
      default:
        if (!fifo.empty()) {
          popped.push_back(backlog.PopNext());
          expected.push_back(fifo.front());
          fifo.pop_front();
        }
    }
    ASSERT_EQ(backlog.size(), fifo.size());
  }
  while (!fifo.empty()) {
    popped.push_back(backlog.PopNext());
    expected.push_back(fifo.front());
    fifo.pop_front();
  }
  EXPECT_EQ(popped, expected);
  EXPECT_TRUE(backlog.empty());
}

// Each owner's items come out in its own FIFO order however the owners
// interleave.
TEST(RoundRobinBacklogTest, EachOwnerKeepsItsOrderHoweverTheOwnersInterleave) {
  std::vector<IoOwner> owners;
  for (int i = 0; i < 5; ++i) owners.push_back(IoOwner::Next());
  RoundRobinBacklog<std::pair<size_t, int>> backlog;  // (owner index, sequence within it)
  std::vector<int> pushed(owners.size(), 0);
  std::mt19937 random(7);
  for (int i = 0; i < 2000; ++i) {
    const size_t o = random() % owners.size();
    backlog.PushBack(owners[o], {o, pushed[o]++});
  }
  std::vector<int> next(owners.size(), 0);
  for (const auto& [o, seq] : Drain(backlog)) {
    ASSERT_EQ(seq, next[o]) << "owner " << o;
    ++next[o];
  }
  EXPECT_EQ(next, pushed);
}

TEST(RoundRobinBacklogTest, HoldsMoveOnlyItems) {
  const IoOwner a = IoOwner::Next();
  RoundRobinBacklog<std::unique_ptr<int>> backlog;
  backlog.PushBack(a, std::make_unique<int>(1));
  backlog.PushFront(a, std::make_unique<int>(0));
  EXPECT_EQ(*backlog.PopNext(), 0);
  EXPECT_EQ(*backlog.PopNext(), 1);
}

TEST(IoOwnerTest, NextNeverRepeatsNorGivesTheDefault) {
  const IoOwner first = IoOwner::Next();
  const IoOwner second = IoOwner::Next();
  EXPECT_NE(first, second);
  EXPECT_NE(first, IoOwner());
  EXPECT_NE(second, IoOwner());
  EXPECT_EQ(IoOwner(), IoOwner());
}

}  // namespace
}  // namespace fuyou::storage::internal
