// `fuyouctl stats`: the text view of one GetStatsResponse.
//
// The view has hand-made parts (a header line, the storage or traffic table,
// and summary rows such as "speculation" that put related counters on one
// line), and each part names the GetStatsResponse fields it shows
// (ShownFields). Every other scalar field of the response is listed after the
// summary rows, one row each under its proto name, found from the message's
// descriptor (as the Python binding's stats dict is): a field added to
// admin.proto shows up here without a change to fuyouctl, and the view's test
// checks that every field changes the output. Last, the data-parallel jobs
// (data_parallel_jobs): a row per job with its ranks' totals, and a row per
// rank beneath it.
//
// A user other than root and the daemon's own gets STATS_SCOPE_USER: their
// own activity only, no storage paths and no DRAM line.
#pragma once

#include <set>
#include <string>
#include <string_view>

#include "fuyou/v1/admin.pb.h"

namespace fuyou::ctl {

// The text of `fuyouctl stats`; every line ends in '\n'.
std::string RenderStats(const v1::GetStatsResponse& stats);

// The proto names of the fields the hand-made parts of RenderStats show (in
// some scope); every other scalar field gets its own row.
const std::set<std::string_view>& ShownFields();

// "1.50 GiB of 4.00 GiB (37.5%)": DRAM in use of the budget (also `fuyouctl status`).
std::string DramLine(const v1::GetStatsResponse& stats);

bool IsUserScope(const v1::GetStatsResponse& stats);

}  // namespace fuyou::ctl
