// DataParallelName: which rank of which data-parallel job a job is, read from
// its name. A rank of a data-parallel job trains the job `<job>.rank<r>-of<w>`
// (python_client/fuyou/_data_parallel.py, rank_job): r its rank, w the world
// size. The admin API shows the ranks of one job as one row (server/
// data_parallel_groups.h); nothing else in the daemon treats such a job
// differently from any other.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace fuyou {

// Greatest world size read from a name: a larger one is an ordinary job name.
inline constexpr uint32_t kMaxDataParallelWorldSize = 65536;

struct DataParallelName {
  std::string job;  // the data-parallel job: the name before ".rank"
  uint32_t rank = 0;
  uint32_t world_size = 0;
};

// The rank, world size and data-parallel job of `name` when it is exactly
// `<job>.rank<r>-of<w>`: `job` not empty, r and w decimal without sign, leading
// zeros or other characters (r may be "0"), 1 <= w <= kMaxDataParallelWorldSize,
// r < w. Anything else (a user's name that only looks alike, hostile digits)
// is std::nullopt: an ordinary job. Pure; never fails.
std::optional<DataParallelName> ParseDataParallelName(std::string_view name);

// `<job>.rank<r>-of<w>`, the name ParseDataParallelName reads back.
std::string DataParallelJobName(std::string_view job, uint32_t rank, uint32_t world_size);

}  // namespace fuyou
