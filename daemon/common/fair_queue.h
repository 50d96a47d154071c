// FairQueue: work waiting for one shared server (the AdamW kernel, an I/O ring),
// shared between users by the bytes of work, then between each user's flows
// (sessions, job copies) by bytes. Deficit round robin (Shreedhar & Varghese,
// SIGCOMM 1995) at two levels.
//
// Every item carries a FairKey (user, flow) and a cost: the bytes it moves or
// touches. The rule, at each level:
//   - users with something waiting take turns, in the order they came; a user
//     whose turn begins is credited `quantum` bytes (times its flow's weight,
//     see below), and is served while the cost of its next item fits its credit;
//     then the turn passes to the next user and the credit left is kept for the
//     user's next turn;
//   - within a user, its flows take turns by the same rule, with credits of
//     their own: the user's next item is the next item of the flow whose turn it
//     is within the user;
//   - a user (flow) whose last item is popped leaves the turns and loses its
//     credit; when it has an item again it joins at the end (PushBack) or at
//     the front (PushFront).
// So, with costs of at most `quantum`, each user with work waiting gets one
// quantum of bytes per round, however many flows or items it has: k users
// waiting share the server ~1/k each by bytes, and an item of a user that
// arrives waits for at most about one quantum of each other user's work (plus
// what is running). A user's share does not grow with its sessions. Items that
// cost more than a quantum wait until their user has saved enough credit over
// several rounds. Within one flow the order is its FIFO (PushBack behind,
// PushFront ahead); one flow alone is served exactly as one std::deque fed by
// the same push_back and push_front calls.
//
// Weights: a flow's weight (FairKey::weight, 1..kMaxFairWeight) scales the
// credit it gets within its user and, when it is its user's next flow, the
// credit its user gets: a background flow of weight 1 next to foreground flows
// of weight kForegroundWeight gets 1/kForegroundWeight of their share, at both
// levels. The weight of a flow is that of its first item while it waits.
//
// Not thread-safe: the caller's lock guards it. Pushes are O(1) (a hash lookup);
// a pop is O(1) when costs are at most a quantum, else O(rounds it waits).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <unordered_map>
#include <utility>

namespace fuyou {

inline constexpr uint32_t kMaxFairWeight = 64;
// The weight of ordinary work (a session's); background work (a job copy) uses
// a smaller one.
inline constexpr uint32_t kForegroundWeight = 4;

// Whose an item is. `user` is the first level (the daemon uses the client's uid),
// `flow` the second (a session or a job copy, unique within the process).
struct FairKey {
  uint64_t user = 0;
  uint64_t flow = 0;
  uint32_t weight = kForegroundWeight;  // clamped to [1, kMaxFairWeight]
};

template <typename T>
class FairQueue {
 public:
  // quantum: the bytes a user (a flow) is credited at each of its turns; > 0.
  explicit FairQueue(uint64_t quantum) : quantum_(quantum == 0 ? 1 : quantum) {}

  // `item`, costing `cost` bytes, waits behind everything key's flow has waiting.
  void PushBack(FairKey key, uint64_t cost, T item) {
    FlowOf(key, /*first=*/false).items.push_back(Entry{cost, std::move(item)});
  }
  // `item` waits ahead of everything key's flow has waiting (it continues work
  // already started). A flow (user) that had nothing waiting takes the next turn.
  void PushFront(FairKey key, uint64_t cost, T item) {
    FlowOf(key, /*first=*/true).items.push_front(Entry{cost, std::move(item)});
  }

  // The next item by the rule above. Precondition: !empty().
  T PopNext() {
    for (;;) {
      User& user = users_.front();
      Flow& flow = NextFlowOf(user);
      if (!user.in_turn) {
        user.credit += Credit(flow.weight);
        user.in_turn = true;
      }
      const uint64_t cost = flow.items.front().cost;
      if (cost <= user.credit) {
        T item = std::move(flow.items.front().item);
        flow.items.pop_front();
        flow.credit -= cost;
        user.credit -= cost;
        --size_;
        if (flow.items.empty()) {
          user.by_flow.erase(flow.id);
          user.flows.erase(user.flows.begin());
        }
        if (user.flows.empty()) {
          by_user_.erase(user.id);
          users_.erase(users_.begin());
        }
        return item;
      }
      user.in_turn = false;
      users_.splice(users_.end(), users_, users_.begin());
    }
  }

  bool empty() const { return size_ == 0; }
  // Items waiting, in all.
  size_t size() const { return size_; }
  // Users with something waiting.
  size_t users() const { return users_.size(); }
  // Items `key`'s flow has waiting.
  size_t waiting(FairKey key) const {
    auto user = by_user_.find(key.user);
    if (user == by_user_.end()) return 0;
    auto flow = user->second->by_flow.find(key.flow);
    return flow == user->second->by_flow.end() ? 0 : flow->second->items.size();
  }

 private:
  struct Entry {
    uint64_t cost;
    T item;
  };
  struct Flow {
    uint64_t id;
    uint32_t weight;
    std::deque<Entry> items;  // never empty while the flow is in its user's turns
    uint64_t credit = 0;
    bool in_turn = false;  // credited for the turn it is in
  };
  using Flows = std::list<Flow>;
  struct User {
    uint64_t id;
    Flows flows;  // flows with something waiting, in the order of their turns
    std::unordered_map<uint64_t, typename Flows::iterator> by_flow;
    uint64_t credit = 0;
    bool in_turn = false;
  };
  using Users = std::list<User>;

  // What one turn credits at `weight`: quantum_ at kForegroundWeight, never 0.
  uint64_t Credit(uint32_t weight) const {
    const uint64_t w = weight == 0 ? 1 : weight > kMaxFairWeight ? kMaxFairWeight : weight;
    const uint64_t credit = quantum_ / kForegroundWeight * w;
    return credit == 0 ? 1 : credit;
  }
  // The user's flow whose turn it is and whose credit covers its next item:
  // flows whose credit does not pass the turn on, each credited as its turn
  // begins. Calling it again without a pop returns the same flow.
  Flow& NextFlowOf(User& user) {
    for (;;) {
      Flow& flow = user.flows.front();
      if (!flow.in_turn) {
        flow.credit += Credit(flow.weight);
        flow.in_turn = true;
      }
      if (flow.items.front().cost <= flow.credit) return flow;
      flow.in_turn = false;
      user.flows.splice(user.flows.end(), user.flows, user.flows.begin());
    }
  }

  // key's flow, made (at the front of the turns when `first`, else at the end,
  // at both levels) when it had nothing waiting; counts the item about to be added.
  Flow& FlowOf(FairKey key, bool first) {
    ++size_;
    auto user_it = by_user_.find(key.user);
    if (user_it == by_user_.end()) {
      auto made = users_.insert(first ? users_.begin() : users_.end(), User{key.user, {}, {}});
      user_it = by_user_.emplace(key.user, made).first;
    }
    User& user = *user_it->second;
    auto flow_it = user.by_flow.find(key.flow);
    if (flow_it != user.by_flow.end()) return *flow_it->second;
    auto made = user.flows.insert(first ? user.flows.begin() : user.flows.end(), Flow{key.flow, key.weight, {}});
    return *user.by_flow.emplace(key.flow, made).first->second;
  }

  const uint64_t quantum_;
  Users users_;  // users with something waiting, in the order of their turns
  std::unordered_map<uint64_t, typename Users::iterator> by_user_;
  size_t size_ = 0;
};

}  // namespace fuyou
