"""Data parallel, the overlap with backward (issue 24): each chunk's gradients
averaged over the ranks while backward goes on and written into ``.grad`` at
its end, as DDP does (fuyou/_dp_overlap.py), checked against torch.optim.AdamW
on the averaged gradient after every step, with the reduction counters read
after each backward pass, before step(); ``clip_grad_norm_`` in the loop
against torch's on the global batch; a per-rank edit refused on every rank.
Also ``process_group=False``. Real gloo ranks (dp_overlap_worker.py), one
fuyoud."""

from __future__ import annotations

from pathlib import Path

import pytest

from dp_ranks import run_worker

RANK_TIMEOUT_S = 300  # generous: a loaded 2-core machine


def run_ranks(tmp: Path, world: int, *flags: str) -> list:
    """Runs `world` ranks of dp_overlap_worker.py; their results by rank, each
    checked to have matched torch after every step. No default socket
    answers: rank 0 starts the node's embedded fuyoud on ``tmp/data``."""
    results = run_worker("dp_overlap_worker.py", tmp, world, *flags, timeout_s=RANK_TIMEOUT_S)
    for r, res in enumerate(results):
        assert max(res["worst"]) <= 0.0, f"rank {r} differs from torch: {res['worst']}"
        # after backward .grad held the same average on every rank, as under DDP
        assert not res["data_parallel"] or [s["grads"] for s in res["per_step"]] == \
            [s["grads"] for s in results[0]["per_step"]], f"rank {r}'s .grad differs"
    return results


def started_before_step(res: dict, step: int, micro: int = -1) -> int:
    """Reductions started in backward during `step` up to backward pass `micro`."""
    before = res["per_step"][step - 1]["after_step"] if step else {"started_in_backward": 0}
    return res["per_step"][step]["after_pass"][micro]["started_in_backward"] - \
        before["started_in_backward"]


@pytest.mark.parametrize("world", [2, 3])
def test_every_chunk_is_reduced_during_backward_and_matches_torch(tmp_path, world):
    results = run_ranks(tmp_path, world, "--clip", "--pause-in-backward")
    n = results[0]["all_chunks"]
    assert n >= world and sum(r["own_chunks"] for r in results) == n
    for res in results:
        # every chunk's reduction started in backward, none waited for step()
        assert [started_before_step(res, s) for s in range(3)] == [n, n, n]
        last = res["per_step"][-1]["after_step"]
        assert last["started_at_step"] == 0 and last["reduced_again"] == 0
        assert last["rounds"] == 3 and res["steps_averaged"] == 3  # by fuyou, no DDP
        assert res["committed"] == 3
    # rank 0 owns the last layers: their reductions ended while backward paused
    # before the first layer, and rank 0 sent them to its daemon before step()
    sent = [step["after_step"]["sent_in_backward"] for step in results[0]["per_step"]]
    assert sent[0] >= 1 and sent[1] - sent[0] >= 1 and sent[2] - sent[1] >= 1, sent
    assert results[0]["speculative"] == sent[2]


def test_a_loop_collective_between_backward_and_step_does_not_pair_with_a_reduction(tmp_path):
    # rank 0 starts every reduction in backward, rank 1 (overlap off) at step();
    # the loss all-reduced on the default group in between meets rank 1 first
    results = run_ranks(tmp_path, 2, "--no-overlap-rank", "1", "--log-loss", "--clip")
    n = results[0]["all_chunks"]
    assert [started_before_step(results[0], s) for s in range(3)] == [n, n, n]
    # overlap off: every reduction starts at the end of backward, nothing is sent
    # during backward
    assert [started_before_step(results[1], s) for s in range(3)] == [0, 0, 0]
    assert results[1]["per_step"][-1]["after_step"]["started_at_pass_end"] == 3 * n
    assert results[1]["per_step"][-1]["after_step"]["started_at_step"] == 0
    assert results[1]["per_step"][-1]["after_step"]["sent_in_backward"] == 0


def test_declared_accumulation_reduces_only_after_the_last_micro_batch(tmp_path):
    results = run_ranks(tmp_path, 2, "--micro", "2", "--declare")
    n = results[0]["all_chunks"]
    for res in results:
        for s in range(3):
            assert started_before_step(res, s, micro=0) == 0
            assert started_before_step(res, s, micro=1) == n
        assert res["per_step"][-1]["after_step"]["reduced_again"] == 0


def test_undeclared_accumulation_is_reduced_again_then_learned(tmp_path):
    results = run_ranks(tmp_path, 2, "--micro", "2")
    n = results[0]["all_chunks"]
    for res in results:
        # step 0: reduced after the first pass, reduced again at the second's end
        assert started_before_step(res, 0, micro=0) == n
        assert res["per_step"][0]["after_pass"][1]["reduced_again"] == n
        # learned at the commit: later steps wait for the second pass
        for s in (1, 2):
            assert started_before_step(res, s, micro=0) == 0
            assert started_before_step(res, s, micro=1) == n
        assert res["per_step"][-1]["after_step"]["reduced_again"] == n


def test_gradients_edited_alike_before_step_are_taken_from_grad(tmp_path):
    results = run_ranks(tmp_path, 2, "--edit-grads", "--clip")
    n = results[0]["all_chunks"]
    for res in results:
        counts = res["per_step"][-1]["after_step"]
        assert counts["edited_in_loop"] == 3 * n and counts["reduced_again"] == 0


@pytest.mark.parametrize("drop", ["1", "0,1"], ids=["one-rank", "every-rank"])
def test_a_parameter_without_gradient_takes_zeros_or_is_not_updated(tmp_path, drop):
    # one rank without it: averaged with zeros, as DDP does; no rank: not updated
    # at all (no weight decay), as torch leaves a parameter whose .grad is None
    results = run_ranks(tmp_path, 2, "--drop-last", drop)
    for res in results:  # (no rank without: the same .grad on every rank, see run_ranks)
        last = [s["grads"][-1] for s in res["per_step"]]
        assert all(g is None for g in last) if drop == "0,1" else all(g for g in last)


def test_ddp_is_detected_once_and_not_reduced_again(tmp_path):
    results = run_ranks(tmp_path, 2, "--ddp", "--clip", "--micro", "2")
    n = results[0]["all_chunks"]
    for res in results:
        counts = res["per_step"][-1]["after_step"]
        assert counts["rounds_found_ddp"] == 1  # the first step found DDP's average
        assert started_before_step(res, 0) == n
        assert started_before_step(res, 1) == 0 and started_before_step(res, 2) == 0
        assert res["steps_averaged"] == 0  # nothing averaged again


def test_ddp_told_to_reduce_nothing_leaves_the_overlap_to_fuyou(tmp_path):
    results = run_ranks(tmp_path, 2, "--ddp", "--skip-ddp-allreduce", "--clip", "--micro", "2",
                        "--declare")
    n = results[0]["all_chunks"]
    for res in results:
        counts = res["per_step"][-1]["after_step"]
        assert counts["rounds_found_ddp"] == 0 and counts["reduced_again"] == 0
        assert [started_before_step(res, s) for s in range(3)] == [n, n, n]
        assert res["steps_averaged"] == 3  # by fuyou


def test_an_inf_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    # no clipping: only the agreed overflow flag tells rank 1 (a non-finite
    # norm would tell every rank by itself)
    results = run_ranks(tmp_path, 2, "--loss-scale", "--inf-at", "1")
    for res in results:
        assert res["skipped"] == 1 and res["committed"] == 2


def test_process_group_false_is_a_single_process_optimizer(tmp_path):
    results = run_ranks(tmp_path, 2, "--solo")
    for r, res in enumerate(results):
        assert not res["data_parallel"] and res["job"] == f"solo{r}"
        assert res["own_chunks"] == res["all_chunks"] and res["committed"] == 3


@pytest.mark.parametrize("flags", [(), ("--micro", "2", "--declare"), ("--micro", "2"),
                                   ("--no-overlap",), ("--no-overlap", "--micro", "2")],
                         ids=["one-pass", "declared-accumulation", "undeclared-accumulation",
                              "overlap-off", "overlap-off-accumulation"])
def test_clip_grad_norm_in_the_loop_sees_the_average_and_matches_torch(tmp_path, flags):
    # clip_grad_norm_ between backward and step(), fuyou not clipping: the norm of
    # the global gradients, as DDP + clip_grad_norm_ or one process on the whole
    # batch gives it; every chunk the clip changed is redone from .grad
    results = run_ranks(tmp_path, 2, "--loop-clip", *flags)
    n = results[0]["all_chunks"]
    for res in results:
        counts = res["per_step"][-1]["after_step"]
        assert counts["edited_in_loop"] == 3 * n  # the clip scaled every chunk
        assert counts["started_at_step"] == 0 and res["committed"] == 3


@pytest.mark.parametrize("flags", [("--ddp",), ("--ddp", "--skip-ddp-allreduce")],
                         ids=["ddp", "ddp-reducing-nothing"])
def test_clip_grad_norm_in_the_loop_under_ddp_matches_torch(tmp_path, flags):
    results = run_ranks(tmp_path, 2, "--loop-clip", "--micro", "2", *flags)
    for res in results:
        assert res["committed"] == 3
        assert res["per_step"][-1]["after_step"]["rounds_found_ddp"] == \
            (0 if "--skip-ddp-allreduce" in flags else 1)


def run_failing(tmp: Path, *flags: str) -> list:
    return run_worker("dp_overlap_worker.py", tmp, 2, *flags, errors_allowed=True,
                      timeout_s=RANK_TIMEOUT_S)


def test_an_edit_that_differs_between_ranks_raises_on_every_rank(tmp_path):
    for res in run_failing(tmp_path, "--edit-apart", "--steps", "1"):
        assert "FailedPrecondition" in res["error"], res
        assert "changed .grad differently on the ranks" in res["error"]
        assert "max_grad_norm=" in res["error"] and "DDP" in res["error"]


def test_a_clip_after_fewer_passes_than_declared_raises_on_every_rank(tmp_path):
    # accumulation_steps=2, one pass: .grad still each rank's own when clipped
    for res in run_failing(tmp_path, "--loop-clip", "--accumulation-steps", "2",
                           "--steps", "1"):
        assert "FailedPrecondition" in res["error"], res
        assert "declare accumulation_steps=" in res["error"]
