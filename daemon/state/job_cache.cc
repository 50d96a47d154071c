#include "state/job_cache.h"

#include <utility>

namespace fuyou {

JobCache::JobCache(StateCache& cache, std::string job_key)
    : cache_(cache), states_name_(std::move(job_key)), undo_name_(states_name_ + "#undo"),
      weights_name_(states_name_ + "#weights") {}

const std::string& JobCache::Name(CacheSpace space) const {
  switch (space) {
    case CacheSpace::kUndo: return undo_name_;
    case CacheSpace::kWeights: return weights_name_;
    case CacheSpace::kStates: break;
  }
  return states_name_;
}

}  // namespace fuyou
