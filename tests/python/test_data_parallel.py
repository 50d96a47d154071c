"""Data parallel over torch.distributed (issue 24): gloo ranks as subprocesses
(dp_worker.py) on one node, each with its own batches, against torch.optim.AdamW
on the averaged gradient after every step; one embedded fuyoud for the node;
per-rank jobs that resume (another world size: test_dp_resume.py)."""

from __future__ import annotations

from pathlib import Path

from dp_ranks import assert_matches_torch, run_worker
from fuyou._data_parallel import split_by_bytes

RANK_TIMEOUT_S = 300  # generous: a loaded 2-core machine


def run_ranks(tmp: Path, world: int, *flags: str, name: str = "run") -> list:
    """Runs `world` ranks of dp_worker.py; their results, by rank (an "error"
    in one is for the test to judge). Every rank finds the node's daemon
    itself: no default socket answers, so rank 0 starts an embedded fuyoud on
    ``tmp/data``."""
    return run_worker("dp_worker.py", tmp, world, *flags, name=name, errors_allowed=True,
                      timeout_s=RANK_TIMEOUT_S)


def test_split_by_bytes_is_contiguous_balanced_and_empty_only_without_items_enough():
    assert split_by_bytes([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert split_by_bytes([5], 2) == [(0, 1), (1, 1)]  # a rank may own no chunk
    assert split_by_bytes([5, 5], 3) == [(0, 1), (1, 2), (2, 2)]
    assert split_by_bytes([10, 1, 1, 10], 2) == [(0, 2), (2, 4)]
    assert split_by_bytes([100, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]
    assert split_by_bytes([1, 1, 1, 100], 2) == [(0, 3), (3, 4)]


def test_two_ranks_with_clipping_match_torch_on_the_averaged_gradient(tmp_path):
    # step 1 sets .grad = None on two parameters after backward, on every rank:
    # they skip that step (weights and step counts as torch's, clip without them)
    results = run_ranks(tmp_path, 2, "--clip", "--drop-grad-steps", "1")
    assert_matches_torch(results, 3)
    for res in results:
        assert res["step_counts"] == res["torch_step_counts"] == [2, 3, 3, 2, 3, 3], res
    # one daemon for the node: rank 0 started it, rank 1 connected to it
    assert [r["embedded"] for r in results] == [True, False]
    assert results[0]["address"] == results[1]["address"]
    assert [r["job"] for r in results] == ["dp.rank0-of2", "dp.rank1-of2"]
    # whole chunks split between the ranks, every chunk owned once
    assert all(0 < r["own_chunks"] < r["all_chunks"] for r in results)
    assert sum(r["own_chunks"] for r in results) == results[0]["all_chunks"]
    assert [r["steps_averaged"] for r in results] == [3, 3]  # fuyou reduced: no DDP
    assert all(r["final_committed"] == 3 for r in results)
    assert all(r["state_dict_states"] == 6 for r in results)  # every parameter's


def test_ddp_with_accumulation_is_not_averaged_again_and_matches_torch(tmp_path):
    results = run_ranks(tmp_path, 2, "--ddp", "--accumulate")
    assert_matches_torch(results, 3)
    assert [r["steps_averaged"] for r in results] == [0, 0]  # DDP did it


def test_resume_with_the_same_world_size(tmp_path):
    assert_matches_torch(run_ranks(tmp_path, 2, "--steps-to", "2", name="first"), 2)
    resumed = run_ranks(tmp_path, 2, "--steps-from", "2", "--steps-to", "4", name="again")
    assert_matches_torch(resumed, 2)
    for res in resumed:
        assert res["resumed"] and res["committed"] == 2 and res["final_committed"] == 4
        assert res["start_violation"] <= 0.0  # the committed weights, on every rank
    # another world size reshards: test_dp_resume.py


def test_a_rank_whose_chunks_get_no_gradient_still_commits_the_step(tmp_path):
    # step 1 reaches only the last layer: rank 1's shard (the first layers) has
    # no gradient, so it sends nothing; it commits the step all the same, and
    # the ranks resume together (before the fix its job stayed one step behind
    # and the resume was refused as ranks at different steps)
    first = run_ranks(tmp_path, 2, "--head-only-step", "1", name="first")
    assert_matches_torch(first, 3)
    assert [r["final_committed"] for r in first] == [3, 3]
    resumed = run_ranks(tmp_path, 2, "--head-only-step", "1", "--steps-from", "3",
                        "--steps-to", "4", name="again")
    assert_matches_torch(resumed, 1)
    assert [(r["committed"], r["final_committed"]) for r in resumed] == [(3, 4), (3, 4)]


def test_default_chunk_bytes_on_a_small_model_and_weight_edits(tmp_path):
    """A small model at the default chunk_bytes is one chunk: rank 0 owns it,
    rank 1 none, and both train as torch (issue 31: it was refused). Weights
    edited before the first step and between steps (a no_grad rescale, a WGAN
    clamp through .data, the same on every rank) go into the masters as in the
    resident mode of one process."""
    first = run_ranks(tmp_path, 2, "--chunk-bytes", "0", "--edit-steps", "0,2",
                      "--steps-to", "3", name="first")
    assert_matches_torch(first, 3)
    assert [(r["own_chunks"], r["all_chunks"]) for r in first] == [(1, 1), (0, 1)]
    assert all(r["final_committed"] == 3 for r in first)
    again = run_ranks(tmp_path, 2, "--chunk-bytes", "0", "--edit-steps", "0,2",
                      "--steps-from", "3", "--steps-to", "4", name="again")
    assert_matches_torch(again, 1)  # the rank without a chunk resumes too
    assert [(r["resumed"], r["committed"], r["final_committed"]) for r in again] == [
        (True, 3, 4), (True, 3, 4)]


def test_weights_edited_on_one_rank_only_are_refused_on_every_rank(tmp_path):
    results = run_ranks(tmp_path, 2, "--edit-steps", "1", "--edit-only-rank", "0",
                        "--steps-to", "2")
    for res in results:
        assert "FailedPrecondition" in res["error"], res
        assert "edited outside step() differently on the ranks" in res["error"], res
        assert "parameters 0 (32, 16)" in res["error"], res


def test_ddp_find_unused_parameters_with_a_layer_unused_on_one_rank(tmp_path):
    """DistributedDataParallel(find_unused_parameters=True), rank 1's forward
    leaving the first layers unused: DDP's average (rank 0's gradient / 2 there)
    on every rank, as torch's optimizer gets it (issue 31)."""
    results = run_ranks(tmp_path, 2, "--ddp", "--find-unused", "--head-only-rank", "1",
                        "--steps-to", "4")
    assert_matches_torch(results, 4)


def test_fuyou_reductions_with_a_layer_unused_on_one_rank(tmp_path):
    results = run_ranks(tmp_path, 2, "--head-only-rank", "1", "--steps-to", "4")
    assert_matches_torch(results, 4)


def test_ranks_that_disagree_on_the_job_are_refused_on_every_rank(tmp_path):
    results = run_ranks(tmp_path, 2, "--job-of-rank")
    for res in results:
        assert "InvalidArgument" in res["error"], res
        assert "built their optimizers differently" in res["error"], res
        assert "rank 1: job 'dp1' instead of 'dp0'" in res["error"], res
