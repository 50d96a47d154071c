// RoundRobinBacklog: what waits for a ring, one FIFO per IoOwner, served in turns.
// Private to the storage module; UringQueue keeps one per ring (io_engine.h,
// "Owners").
//
// The rule: PopNext takes the first item of the owner whose turn it is, then that
// owner's turn passes to the next owner with something waiting; an owner whose
// FIFO empties leaves the turn, and one that gets an item again joins at the end
// (PushBack) or at the front (PushFront). So with k owners waiting, each is
// served once in every k pops, and an owner that arrives waits for at most one
// item of each owner already waiting. Within one owner the order is its FIFO:
// PushBack behind, PushFront ahead of what it has waiting. With one owner only,
// PopNext gives exactly what a single std::deque fed by the same push_back and
// push_front calls would.
//
// Not thread-safe: the caller's lock guards it. Every operation is O(1)
// (amortised; one hash lookup).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <iterator>
#include <list>
#include <unordered_map>
#include <utility>

#include "storage/io_engine.h"

namespace fuyou::storage::internal {

template <typename T>
class RoundRobinBacklog {
 public:
  // `item` waits behind everything `owner` has waiting. An owner that had
  // nothing waiting takes its turn after every owner waiting now.
  void PushBack(IoOwner owner, T item) { LineOf(owner, /*first=*/false).items.push_back(std::move(item)); }
  // `item` waits ahead of everything `owner` has waiting (it continues work
  // already started). An owner that had nothing waiting takes the next turn.
  void PushFront(IoOwner owner, T item) { LineOf(owner, /*first=*/true).items.push_front(std::move(item)); }

  // The first item of the owner whose turn it is; the turn passes on.
  // Precondition: !empty().
  T PopNext() {
    auto line = turns_.begin();
    T item = std::move(line->items.front());
    line->items.pop_front();
    --size_;
    if (line->items.empty()) {
      lines_.erase(line->owner.id());
      turns_.erase(line);
    } else {
      turns_.splice(turns_.end(), turns_, line);
    }
    return item;
  }

  bool empty() const { return size_ == 0; }
  // Items waiting, in all.
  size_t size() const { return size_; }
  // Owners with something waiting.
  size_t owners() const { return turns_.size(); }
  // Items `owner` has waiting.
  size_t waiting(IoOwner owner) const {
    auto it = lines_.find(owner.id());
    return it == lines_.end() ? 0 : it->second->items.size();
  }

 private:
  struct Line {
    IoOwner owner;
    std::deque<T> items;  // never empty while the line is in turns_
  };
  using Turns = std::list<Line>;

  // `owner`'s line, made (at the front of the turns when `first`, else at the
  // end) when it had nothing waiting; counts the item about to be added.
  Line& LineOf(IoOwner owner, bool first) {
    ++size_;
    auto it = lines_.find(owner.id());
    if (it != lines_.end()) return *it->second;
    auto line = turns_.insert(first ? turns_.begin() : turns_.end(), Line{owner, {}});
    lines_.emplace(owner.id(), line);
    return *line;
  }

  Turns turns_;  // owners with something waiting, in the order of their turns
  std::unordered_map<uint64_t, typename Turns::iterator> lines_;  // by IoOwner::id()
  size_t size_ = 0;
};

}  // namespace fuyou::storage::internal
