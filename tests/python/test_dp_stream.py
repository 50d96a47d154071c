"""offload_params=True and fuyou.stream_parameters in a data-parallel job
(issue 24; python_client/fuyou/_sharded_streamed.py): two real gloo ranks
(dp_stream_worker.py) sharing one embedded fuyoud, each fetching its modules'
weights from its own job, each updating its own chunks, against
torch.optim.AdamW on the averaged, clipped gradients; then a resume. Each
chunk's gradients are all-reduced during backward and the owner sends its
average to its daemon before backward() returns (the counters say where);
``.grad`` holds the average after backward, so the loop's own
``clip_grad_norm_`` and a ``p.grad.mul_`` see what torch sees on one process."""

from __future__ import annotations

from dp_ranks import assert_matches_torch, node_b_holding_syncs, run_worker


def assert_overlapped(res: dict, steps: int) -> None:
    """Every step's chunks were reduced and this rank's sent during backward,
    none averaged at step()."""
    counts = res["counts"]
    assert counts["averaged_at_step"] == 0, counts
    assert counts["started_in_hooks"] > 0, counts
    assert counts["sent_in_hooks"] + counts["sent_at_pass_end"] == steps * res["own_chunks"], \
        counts
    assert res["speculative"] == steps * res["own_chunks"], res


def test_two_streamed_ranks_match_torch_with_clipping_and_resume(tmp_path):
    # 1 KiB chunks: 9 chunks, a weight split over two of one rank's and another
    # over both ranks' (a module's own chunks may have two owners)
    split = ("--chunk-bytes", "1024")
    first = run_worker("dp_stream_worker.py", tmp_path, 2, "--steps-to", "5", *split,
                       name="first")
    for res in first:
        assert res["placeholders"], res  # the weights live in the daemon
        assert "stream the module itself (ddp.module) without DDP" in res["ddp"]
        assert res["job"] == f"s.rank{res['rank']}-of2"
        assert len(res["worst"]) == 5 and max(res["worst"]) <= 0.0, res["worst"]
        assert res["states"] <= 0.0, res  # opt.state_dict(): torch's moments
        assert res["export"] <= 0.0, res  # export_checkpoint: every chunk's master
        if res["rank"] == 0:  # the sharded export: every rank's weights and moments
            assert max(res["sharded"]) <= 0.0, res["sharded"]
        assert res["committed"] == 5 and res["fetches"] > 0
        assert_overlapped(res, 5)
        # max_grad_norm: every speculative update is redone once the global norm clips
        assert res["redone_changed"] == 0 and res["redone_clipped"] > 0, res
    # every chunk owned by one rank, each rank updating some
    assert [r["all_chunks"] for r in first] == [9, 9]
    assert sum(r["own_chunks"] for r in first) == 9 and all(r["own_chunks"] for r in first)
    assert first[0]["alone"] <= 0.0  # model.state_dict() on rank 0 alone
    for res in first:  # model.load_state_dict on rank 0 alone: refused on every rank
        assert "call model.load_state_dict on every rank" in res["uneven_load"], res
    # another world size: refused on every rank, the old jobs untouched (not trained
    # anew beside them, as it was before)
    three = run_worker("dp_stream_worker.py", tmp_path, 3, "--steps-from", "5",
                       "--steps-to", "6", *split, name="three", errors_allowed=True)
    for res in three:
        assert "trained with 2 rank(s)" in res.get("error", ""), res
        assert "with offload_params is not implemented" in res["error"]
    # resumed, and torch.optim.AdamW's own state dict of step 5 loaded into it
    again = run_worker("dp_stream_worker.py", tmp_path, 2, "--steps-from", "5",
                       "--steps-to", "7", "--load-torch", *split, name="again")
    for res in again:
        assert res["resumed"] and res["start"] <= 0.0, res
        assert len(res["worst"]) == 2 and max(res["worst"]) <= 0.0, res["worst"]
        assert res["committed"] == 7 and res["states"] <= 0.0


def test_two_streamed_ranks_accumulate_and_skip_an_overflow_on_one_rank(tmp_path):
    # and weights edited between steps on every rank (a no_grad rescale, a .data
    # clamp of the placeholders): each rank takes them into its job's masters
    results = run_worker("dp_stream_worker.py", tmp_path, 2, "--accumulate",
                         "--overflow-at", "2", "--steps-to", "4", "--edit-steps", "0,3",
                         "--edit-in-forward")
    for res in results:
        assert res["edits_taken"] == 2 * 7, res  # a rescale and 6 clamps, twice
        # then rank 0 alone edits model[2]'s weights through .data inside its forward
        assert "parameter '2.weight'" in res["edit_in_forward"], res
        assert "changed in place outside step() while its module held" in res["edit_in_forward"]
        assert res["committed_after_edit"] == 4, res  # refused once on both ranks, then taken
        assert len(res["worst"]) == 4 and max(res["worst"]) <= 0.0, res["worst"]
        assert res["skipped"] == 1 and res["committed"] == 3, res
        assert res["loss_scale"] == 2.0 ** 15  # backed off once, on every rank
        assert res["states"] <= 0.0, res


def test_plain_steps_are_reduced_and_sent_during_backward(tmp_path):
    # no clip: every speculative update stands, but step 3's p.grad.mul_(0.5)
    # (on every rank alike) changes the own chunks, which step() redoes
    results = run_worker("dp_stream_worker.py", tmp_path, 2, "--clip", "none",
                         "--halve-at", "3", "--steps-to", "4", "--chunk-bytes", "1024")
    assert_matches_torch(results, 4)
    for res in results:
        assert_overlapped(res, 4)
        assert res["counts"]["passes_averaged"] == 4, res["counts"]
        assert res["redone_changed"] == res["own_chunks"] and res["redone_clipped"] == 0, res


def test_clip_grad_norm_in_the_loop_sees_the_averaged_gradients(tmp_path):
    # torch.nn.utils.clip_grad_norm_ between backward and step(), two
    # micro-batches a step (the first step learns them: its first pass averages
    # too, the second averages again): as torch on the global batch
    results = run_worker("dp_stream_worker.py", tmp_path, 2, "--clip", "loop", "--accumulate",
                         "--steps-to", "4", "--chunk-bytes", "1024")
    assert_matches_torch(results, 4)
    for res in results:
        assert_overlapped(res, 4)
        assert res["counts"]["passes"] == 8 and res["counts"]["passes_averaged"] == 5, res
        assert res["redone_changed"] == 4 * res["own_chunks"], res  # the clip changed them


def test_overlap_off_and_a_first_step_averaged_at_step(tmp_path):
    # overlap=False: the passes still average .grad, nothing is sent before step()
    (tmp_path / "off").mkdir()
    results = run_worker("dp_stream_worker.py", tmp_path / "off", 2, "--clip", "loop",
                         "--no-overlap", "--steps-to", "3", "--chunk-bytes", "1024")
    assert_matches_torch(results, 3)
    for res in results:
        counts = res["counts"]
        assert counts["passes_averaged"] == 3 and counts["averaged_at_step"] == 0, counts
        assert counts["sent_in_hooks"] + counts["sent_at_pass_end"] == 0, counts
        assert res["speculative"] == 0 and res["redone_changed"] == 0, res
    # accumulation_steps=2 declared, one pass made: the first step's pass is
    # not the last expected, step() averages it; the next steps learned one pass
    (tmp_path / "declared").mkdir()
    results = run_worker("dp_stream_worker.py", tmp_path / "declared", 2, "--clip", "none",
                         "--declare-passes", "2", "--steps-to", "3", "--chunk-bytes", "1024")
    assert_matches_torch(results, 3)
    for res in results:
        counts = res["counts"]
        assert counts["averaged_at_step"] == 1 and counts["passes_averaged"] == 2, counts
        assert res["speculative"] == 2 * res["own_chunks"], res


# ---------------------------------------------------------------- never lose a step
def _cut_while_step_3_is_not_durable_on_node_b(tmp_path, *flags):
    """Trains steps 1-2, then holds step 3's durable commit on node b's fuyoud
    (after its EndStep answered) and SIGKILLs that fuyoud 5 s later: the ranks'
    results (both fail)."""
    release = tmp_path / "release-syncs"
    release.write_text("")
    cut = run_worker("dp_stream_worker.py", tmp_path, 2, "--steps-to", "4",
                     "--hold-commit-at", f"0:2:{release}", *flags, name="cut",
                     env_of=node_b_holding_syncs(tmp_path, "s.rank0-of2", release),
                     errors_allowed=True)
    assert cut[0]["held_step"] == 3, cut[0]
    assert all("error" in r for r in cut), cut
    return cut


def test_a_fuyoud_killed_before_its_step_was_durable_leaves_every_rank_able_to_resume(tmp_path):
    """Issue 24, "never lose a step": node b's fuyoud dies after answering
    EndStep 3 but before step 3 was durable there. Rank 1 (node a) has step 3
    durable; it must not write again (the copies' import, step 4's updates)
    before rank 0's step 3 is durable too (DurableGate): it raises there, its
    job still able to go back to step 2, where rank 0's resumes. The restart
    resumes both at step 2 and matches torch."""
    cut = _cut_while_step_3_is_not_durable_on_node_b(tmp_path)
    assert "another rank's step 3 is not durable" in cut[1]["error"], cut[1]
    assert cut[1]["committed"] == 3 and cut[1]["durable_gates"] == 2, cut[1]
    resumed = run_worker("dp_stream_worker.py", tmp_path, 2, "--steps-from", "2",
                         "--steps-to", "4", name="resumed",
                         env_of=node_b_holding_syncs(tmp_path, "s.rank0-of2"))
    for res in resumed:
        assert res["resumed"] and res["start"] <= 0.0, res
        assert len(res["worst"]) == 2 and max(res["worst"]) <= 0.0, res["worst"]
        assert res["committed"] == 4 and res["states"] <= 0.0, res
        assert res["durable_gates"] == 2, res  # after steps 3 and 4, before their imports

