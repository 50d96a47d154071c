"""Data parallel across restarts (issue 24): a changed world size resharded
(W -> W', a single-process job -> W ranks, W ranks -> one process), a rank killed mid-step or during
a reshard, and two nodes simulated as two fuyouds. Real gloo ranks as
subprocesses (dp_resume_worker.py), real fuyouds, compared with
torch.optim.AdamW on the same batches."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import start_daemon
from dp_ranks import assert_matches_torch, node_b_holding_syncs, run_worker
from fuyou._dp_jobs import JobRecord, plan_world

RANK_TIMEOUT_S = 300  # generous: a loaded 2-core machine
FAIL_BOUND_S = 60  # a survivor's error after a peer was killed, measured from its step's start


def run_ranks(tmp: Path, world: int, *flags: str, name: str, env_of=None,
              expect_killed=()) -> list:
    """Runs `world` ranks of dp_resume_worker.py; their results by rank (None
    for the ranks in `expect_killed`, which must die by SIGKILL; an "error" in
    one is for the test to judge). `env_of(r)`: extra environment of rank r.
    Without it every rank shares one node whose leader starts an embedded
    fuyoud on ``tmp/data``."""
    return run_worker("dp_resume_worker.py", tmp, world, *flags, name=name, env_of=env_of,
                      expect_killed=expect_killed, errors_allowed=True, timeout_s=RANK_TIMEOUT_S)


def listed_jobs(address: str) -> dict:
    import fuyou
    return {j["name"]: j["committed_step"] for j in fuyou.admin_client(address).list_jobs()}


# ---------------------------------------------------------------- the decision
def rec(name, step=3, node="n", chunks=2):
    return JobRecord(name, node, step, chunks)


def test_plan_world_resumes_its_own_world_and_starts_new_without_jobs():
    assert not plan_world("dp", 2, []).reshard
    own = plan_world("dp", 2, [rec("dp.rank0-of2"), rec("dp.rank1-of2"), rec("other.rank0-of3")])
    assert not own.reshard and not own.delete_first and own.error is None


def test_plan_world_reshards_the_trained_world_and_deletes_untrained_leftovers_first():
    jobs = [rec("dp.rank0-of2"), rec("dp.rank1-of2"),  # trained
            rec("dp.rank0-of3", 0), rec("dp.rank2-of3", 0)]  # an interrupted reshard's
    plan = plan_world("dp", 3, jobs)
    assert plan.reshard and plan.source_world == 2 and plan.source_step == 3
    assert [j.name for j in plan.source_jobs] == ["dp.rank0-of2", "dp.rank1-of2"]
    assert [j.name for j in plan.delete_first] == ["dp.rank0-of3", "dp.rank2-of3"]
    assert [j.name for j in plan.delete_after] == ["dp.rank0-of2", "dp.rank1-of2"]
    # the same jobs seen from a start with 2 ranks: resume, the leftovers go
    back = plan_world("dp", 2, jobs)
    assert not back.reshard and [j.name for j in back.delete_first] == ["dp.rank0-of3", "dp.rank2-of3"]
    # a single-process job is a world of one
    single = plan_world("dp", 2, [rec("dp", 5, chunks=4)])
    assert single.source_world == 1 and single.source_step == 5


def test_plan_world_trusts_the_marker_of_a_committed_reshard():
    # the reshard into 3 committed (marker, at the old step 3); rank 1 took the
    # step, the others not yet, and the deletion of the old jobs was cut short
    jobs = [rec("dp.rank1-of2"), rec("dp.rank0-of3", 0), rec("dp.rank1-of3", 3),
            rec("dp.rank2-of3", 0), rec("dp.resharded-to-3", 3, chunks=1)]
    plan = plan_world("dp", 3, jobs)
    assert not plan.reshard and plan.error is None and plan.finishes_reshard
    assert plan.marker.committed_step == 3 and plan.resume_at_step is None
    # the marker goes last, once every rank took its step (finish_reshard)
    assert [j.name for j in plan.delete_first] == ["dp.rank1-of2"]
    assert plan.marker.name == "dp.resharded-to-3" and not plan.delete_after
    again = plan_world("dp", 4, jobs)  # from the committed target, never the old one
    assert again.source_world == 3 and again.source_step == 3 and again.error is None
    assert [j.name for j in again.delete_after][-1] == "dp.resharded-to-3"
    # a marker of an older fuyou (step 0) leaves the steps as they are
    old = plan_world("dp", 3, jobs[:-1] + [rec("dp.resharded-to-3", 0, chunks=1)])
    assert old.finishes_reshard and old.marker.committed_step == 0
    # nothing left but the marker (the old jobs gone): only its deletion is due
    done = plan_world("dp", 3, [rec("dp.rank0-of3"), rec("dp.rank1-of3"), rec("dp.rank2-of3"),
                                rec("dp.resharded-to-3", 3, chunks=1)])
    assert done.finishes_reshard and not done.delete_first


def test_plan_world_resumes_rank_jobs_one_step_apart_at_the_lower_step():
    own = plan_world("dp", 2, [rec("dp.rank0-of2", 3), rec("dp.rank1-of2", 2)])
    assert own.error is None and not own.reshard and own.resume_at_step == 2
    assert plan_world("dp", 2, [rec("dp.rank0-of2"), rec("dp.rank1-of2")]).resume_at_step is None
    source = plan_world("dp", 3, [rec("dp.rank0-of2", 3), rec("dp.rank1-of2", 2)])
    assert source.reshard and source.source_step == 2 and source.resume_at_step == 2


def test_plan_world_refuses_what_it_cannot_decide_and_says_what_to_do():
    two_trained = plan_world("dp", 4, [rec("dp.rank0-of2"), rec("dp.rank1-of2"), rec("dp")])
    assert "several world sizes" in two_trained.error and "delete the jobs" in two_trained.error
    missing = plan_world("dp", 3, [rec("dp.rank0-of2")])
    assert "1 of 2 rank jobs (rank 0: step 3)" in missing.error
    skewed = plan_world("dp", 3, [rec("dp.rank0-of2", 3), rec("dp.rank1-of2", 1)])
    assert "rank 0: step 3, rank 1: step 1" in skewed.error
    two_apart = plan_world("dp", 2, [rec("dp.rank0-of2", 3), rec("dp.rank1-of2", 1)])
    assert two_apart.resume_at_step is None  # the jobs are opened as they are: refused there
    untrained = plan_world("dp", 2, [rec("dp.rank0-of2", 0), rec("dp.rank1-of2", 0),
                                     rec("dp.rank0-of3", 0), rec("dp.rank1-of3", 0),
                                     rec("dp.rank2-of3", 0)])
    assert "which one to resume is not known" in untrained.error


# ---------------------------------------------------------------- reshards
def test_two_ranks_resharded_to_three_and_back_to_two_match_torch(tmp_path):
    history = "2,2,3,3,2"
    first = run_ranks(tmp_path, 2, "--steps-to", "2", "--history", history, name="two")
    assert_matches_torch(first, 2)
    three = run_ranks(tmp_path, 3, "--steps-from", "2", "--steps-to", "4", "--history", history,
                      name="three")
    assert_matches_torch(three, 2)
    for res in three:
        assert res["resharded_from"] == 2 and res["resumed"]
        assert res["start_violation"] <= 0.0  # step 1's weights, on every rank
        assert res["job"] == f"dp.rank{res['rank']}-of3"
        # the steps count on from the old jobs' (CommitImport's resume_step)
        assert res["committed"] == 2 and res["final_committed"] == 4
    back = run_ranks(tmp_path, 2, "--steps-from", "4", "--steps-to", "5", "--history", history,
                     name="back")
    assert_matches_torch(back, 1)
    assert [r["resharded_from"] for r in back] == [3, 3]
    assert [(r["committed"], r["final_committed"]) for r in back] == [(4, 5), (4, 5)]


def test_a_small_model_at_the_default_chunk_bytes_reshards_from_two_ranks_to_three(tmp_path):
    """One chunk (fuyou.AdamW's default chunk_bytes): rank 0 owns it with 2
    ranks and with 3; the ranks that own none reshard, resume and train too."""
    history = "2,2,3"
    two = run_ranks(tmp_path, 2, "--steps-to", "2", "--history", history, "--chunk-bytes", "0",
                    name="two")
    assert_matches_torch(two, 2)
    assert [r["own_chunks"] for r in two] == [1, 0]
    three = run_ranks(tmp_path, 3, "--steps-from", "2", "--steps-to", "3", "--history", history,
                      "--chunk-bytes", "0", name="three")
    assert_matches_torch(three, 1)
    assert [r["own_chunks"] for r in three] == [1, 0, 0]
    assert [(r["resharded_from"], r["committed"], r["final_committed"]) for r in three] == [
        (2, 2, 3)] * 3


def test_a_single_process_job_resharded_to_two_ranks_matches_torch(tmp_path):
    history = "1,1,2,2"
    single = run_ranks(tmp_path, 1, "--steps-to", "2", "--history", history, name="single")
    assert_matches_torch(single, 2)
    assert single[0]["job"] == "dp"
    two = run_ranks(tmp_path, 2, "--steps-from", "2", "--steps-to", "4", "--history", history,
                    name="two")
    assert_matches_torch(two, 2)
    assert [r["resharded_from"] for r in two] == [1, 1]
    assert [r["committed"] for r in two] == [2, 2]


def test_two_ranks_resharded_back_to_one_process_match_torch(tmp_path):
    d = start_daemon(tmp_path)
    try:
        address = ["--address", d.address]
        history = "2,2,1,1,1"
        two = run_ranks(tmp_path, 2, "--steps-to", "2", "--history", history, *address,
                        name="two")
        assert_matches_torch(two, 2)
        # the streamed mode cannot import them (it registers at bind): refused
        import fuyou
        from dp_worker import make_model
        with pytest.raises(fuyou.FailedPrecondition, match="offload_params is not implemented"):
            fuyou.AdamW(make_model().parameters(), job="dp", chunk_bytes=2048,
                        offload_params=True, address=d.address)
        # one process (no torch.distributed) on job "dp": the ranks' jobs are imported
        one = run_ranks(tmp_path, 1, "--steps-from", "2", "--steps-to", "4", "--history",
                        history, *address, name="one")
        assert_matches_torch(one, 2)
        assert one[0]["resharded_from"] == 2 and one[0]["start_violation"] <= 0.0
        assert one[0]["committed"] == 2
        jobs = listed_jobs(d.address)
        assert sorted(n for n in jobs if n.startswith("dp")) == ["dp"]  # ranks' jobs gone
        assert jobs["dp"] == 4
        # and the single-process job resumes as any other
        again = run_ranks(tmp_path, 1, "--steps-from", "4", "--steps-to", "5", "--history",
                          history, *address, name="again")
        assert_matches_torch(again, 1)
        assert again[0]["resharded_from"] is None and again[0]["resumed"]
        assert again[0]["committed"] == 4 and again[0]["start_violation"] <= 0.0
    finally:
        d.stop()


def test_a_reshard_into_one_process_killed_is_run_again_or_finished(tmp_path):
    d = start_daemon(tmp_path)
    try:
        address = ["--address", d.address]
        history = "2,2,1,1"
        assert_matches_torch(run_ranks(tmp_path, 2, "--steps-to", "2", "--history", history,
                                       *address, name="two"), 2)
        # killed after its first imported chunk: the ranks' jobs are untouched
        run_ranks(tmp_path, 1, "--steps-from", "2", "--steps-to", "4", "--history", history,
                  "--die-at", "0:0:reshard", *address, name="cut", expect_killed=(0,))
        jobs = listed_jobs(d.address)
        assert jobs["dp.rank0-of2"] == 2 and jobs["dp.rank1-of2"] == 2
        assert "dp.resharded-to-1" not in jobs
        # killed after the marker: the next start finishes the step and the deletions
        run_ranks(tmp_path, 1, "--steps-from", "2", "--steps-to", "4", "--history", history,
                  "--die-at", "0:0:marker", *address, name="cut2", expect_killed=(0,))
        jobs = listed_jobs(d.address)
        assert jobs["dp.resharded-to-1"] == 2 and jobs["dp"] == 0  # the old step kept there
        one = run_ranks(tmp_path, 1, "--steps-from", "2", "--steps-to", "4", "--history",
                        history, *address, name="one")
        assert_matches_torch(one, 2)
        assert one[0]["start_violation"] <= 0.0 and one[0]["committed"] == 2
        jobs = listed_jobs(d.address)
        assert sorted(n for n in jobs if n.startswith("dp")) == ["dp"]
        assert jobs["dp"] == 4
    finally:
        d.stop()


def test_a_rank_killed_during_the_reshard_leaves_the_old_jobs_usable(tmp_path):
    d = start_daemon(tmp_path)
    try:
        address = ["--address", d.address]
        history = "2,2,3,3"
        assert_matches_torch(run_ranks(tmp_path, 2, "--steps-to", "2", "--history", history,
                                       *address, name="two"), 2)
        cut = run_ranks(tmp_path, 3, "--steps-from", "2", "--steps-to", "4", "--history", history,
                        "--die-at", "2:0:reshard", *address, name="cut", expect_killed=(2,))
        for res in cut[:2]:
            assert "error" in res, res
        jobs = listed_jobs(d.address)
        assert jobs["dp.rank0-of2"] == 2 and jobs["dp.rank1-of2"] == 2  # untouched
        assert "dp.resharded-to-3" not in jobs
        # the old world still resumes as it was ...
        again = run_ranks(tmp_path, 2, "--steps-from", "2", "--steps-to", "2", "--history", history,
                          *address, name="again")
        assert all(r["committed"] == 2 and r["start_violation"] <= 0.0 for r in again)
        # ... and the reshard runs again from the start
        three = run_ranks(tmp_path, 3, "--steps-from", "2", "--steps-to", "4", "--history", history,
                          *address, name="three")
        assert_matches_torch(three, 2)
        jobs = listed_jobs(d.address)
        assert sorted(n for n in jobs if n.startswith("dp.")) == [
            "dp.rank0-of3", "dp.rank1-of3", "dp.rank2-of3"]
    finally:
        d.stop()


def test_a_reshard_killed_after_its_marker_is_finished_by_the_next_start(tmp_path):
    d = start_daemon(tmp_path)
    try:
        address = ["--address", d.address]
        history = "2,2,3,3"
        assert_matches_torch(run_ranks(tmp_path, 2, "--steps-to", "2", "--history", history,
                                       *address, name="two"), 2)
        run_ranks(tmp_path, 3, "--steps-from", "2", "--steps-to", "4", "--history", history,
                  "--die-at", "0:0:marker", *address, name="cut", expect_killed=(0,))
        jobs = listed_jobs(d.address)
        assert "dp.resharded-to-3" in jobs and "dp.rank0-of2" in jobs  # committed, not cleaned
        assert jobs["dp.resharded-to-3"] == 2 and jobs["dp.rank0-of3"] == 0  # rank 0 died first
        three = run_ranks(tmp_path, 3, "--steps-from", "2", "--steps-to", "4", "--history",
                          history, *address, name="three")
        assert_matches_torch(three, 2)
        assert all(r["resharded_from"] is None and r["resumed"] for r in three)  # its own jobs
        assert [r["committed"] for r in three] == [2, 2, 2]  # the marker's step, on every rank
        jobs = listed_jobs(d.address)
        assert sorted(n for n in jobs if n.startswith("dp.")) == [
            "dp.rank0-of3", "dp.rank1-of3", "dp.rank2-of3"]
        assert {jobs[f"dp.rank{r}-of3"] for r in range(3)} == {4}
    finally:
        d.stop()


# ---------------------------------------------------------------- a rank killed
@pytest.mark.parametrize("point", ["backward", "send"])
def test_a_rank_killed_mid_step_makes_the_others_fail_fast_and_resume_together(tmp_path, point):
    d = start_daemon(tmp_path)
    try:
        address = ["--address", d.address, "--timeout", "120"]
        cut = run_ranks(tmp_path, 3, "--steps-to", "4", "--die-at", f"1:2:{point}", *address,
                        name="cut", expect_killed=(1,))
        for res in (cut[0], cut[2]):
            assert res["error_step"] == 2 and "worst" not in res, res
            assert res["error_after_s"] < FAIL_BOUND_S, res  # not the 120 s timeout
            assert res["committed_at_error"] == 2  # the third step committed nowhere
        jobs = listed_jobs(d.address)
        assert [jobs[f"dp.rank{r}-of3"] for r in range(3)] == [2, 2, 2]
        resumed = run_ranks(tmp_path, 3, "--steps-from", "2", "--steps-to", "4", *address,
                            name="resumed")
        assert_matches_torch(resumed, 2)
        assert all(r["committed"] == 2 and r["start_violation"] <= 0.0 for r in resumed)
    finally:
        d.stop()


def test_a_rank_killed_after_its_commit_leaves_every_rank_at_that_step(tmp_path):
    d = start_daemon(tmp_path)
    try:
        address = ["--address", d.address]
        cut = run_ranks(tmp_path, 2, "--steps-to", "4", "--die-at", "1:1:after-end-step", *address,
                        name="cut", expect_killed=(1,))
        assert "error" in cut[0] and cut[0]["error_after_s"] < FAIL_BOUND_S
        resumed = run_ranks(tmp_path, 2, "--steps-from", "2", "--steps-to", "4", *address,
                            name="resumed")
        assert_matches_torch(resumed, 2)
        assert all(r["committed"] == 2 for r in resumed)
    finally:
        d.stop()


def test_a_rank_killed_between_the_agreement_and_its_commit_resumes_at_the_step_before(tmp_path):
    """The ranks' jobs end one step apart; the next start takes the one ahead
    back to the manifest fuyoud kept before its last commit."""
    d = start_daemon(tmp_path)
    try:
        address = ["--address", d.address]
        run_ranks(tmp_path, 2, "--steps-to", "4", "--die-at", "1:1:before-end-step", *address,
                  name="cut", expect_killed=(1,))
        jobs = listed_jobs(d.address)
        assert (jobs["dp.rank0-of2"], jobs["dp.rank1-of2"]) == (2, 1)
        again = run_ranks(tmp_path, 2, "--steps-from", "1", "--steps-to", "3", *address,
                          name="again")
        assert_matches_torch(again, 2)
        assert all(r["committed"] == 1 and r["start_violation"] <= 0.0 for r in again)
        assert all(r["final_committed"] == 3 for r in again)
    finally:
        d.stop()


# ---------------------------------------------------------------- two nodes
def test_two_nodes_with_a_fuyoud_each_match_torch_and_resume(tmp_path):
    def node_env(r):
        node = "a" if r < 2 else "b"
        return {"FUYOU_NODE_ID": f"node-{node}", "FUYOU_DATA_DIR": str(tmp_path / f"data-{node}")}

    first = run_ranks(tmp_path, 4, "--steps-to", "2", name="first", env_of=node_env)
    assert_matches_torch(first, 2)
    assert [r["embedded"] for r in first] == [True, False, True, False]  # a leader per node
    assert first[0]["address"] == first[1]["address"] != first[2]["address"] == first[3]["address"]
    resumed = run_ranks(tmp_path, 4, "--steps-from", "2", "--steps-to", "3", name="resumed",
                        env_of=node_env)
    assert_matches_torch(resumed, 1)
    assert all(r["resumed"] and r["committed"] == 2 for r in resumed)
    # each node's daemon kept its own ranks' jobs
    assert sorted(os.listdir(tmp_path / "data-a" / "users" / str(os.getuid()) / "jobs")) == [
        "dp.rank0-of4", "dp.rank1-of4"]


def test_a_reshard_across_two_nodes_reads_each_old_job_on_its_own_node(tmp_path):
    def node_env(world):
        def env(r):
            node = "a" if r < world // 2 else "b"
            return {"FUYOU_NODE_ID": f"node-{node}",
                    "FUYOU_DATA_DIR": str(tmp_path / f"data-{node}")}
        return env

    history = "2,2,4"
    assert_matches_torch(run_ranks(tmp_path, 2, "--steps-to", "2", "--history", history,
                                   name="two", env_of=node_env(2)), 2)
    four = run_ranks(tmp_path, 4, "--steps-from", "2", "--steps-to", "3", "--history", history,
                     name="four", env_of=node_env(4))
    assert_matches_torch(four, 1)
    assert all(r["resharded_from"] == 2 and r["start_violation"] <= 0.0 for r in four)
    jobs_dir = Path("users") / str(os.getuid()) / "jobs"
    assert sorted(os.listdir(tmp_path / "data-a" / jobs_dir)) == ["dp.rank0-of4", "dp.rank1-of4"]
    assert sorted(os.listdir(tmp_path / "data-b" / jobs_dir)) == ["dp.rank2-of4", "dp.rank3-of4"]


def test_open_session_resume_at_step_goes_back_one_commit_and_no_further(daemon):
    import torch
    import fuyou
    from fuyou._errors import FailedPrecondition
    model = torch.nn.Linear(8, 8)
    opt = fuyou.AdamW(model.parameters(), job="back-one", address=daemon.address, timeout=20.0)
    for _ in range(2):
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    Session = fuyou._native.module().Session

    def open_at(step, job="back-one"):
        return Session.open(job=job, num_slots=1, slot_bytes=4096, address=daemon.address,
                            resume_at_step=step)

    for bad in (0, 3):
        with pytest.raises(FailedPrecondition, match="is at step 2, its previous manifest at step 1"):
            open_at(bad)
    with pytest.raises(FailedPrecondition, match="does not exist"):
        open_at(0, job="never-made")
    assert "never-made" not in listed_jobs(daemon.address)
    s = open_at(2)  # its own step: unchanged
    assert s.committed_step == 2
    s.close()
    s = open_at(1)
    assert s.committed_step == 1
    s.close()
    assert listed_jobs(daemon.address)["back-one"] == 1  # on disk
    with pytest.raises(FailedPrecondition, match="is at step 1, its previous manifest at step 1"):
        open_at(0)


# ---------------------------------------------------------------- never lose a step
def _cut_before_step_3_is_durable_on_node_b(tmp_path, *flags) -> list:
    """Steps 1-2, then step 3's durable commit held on node b's fuyoud after
    its EndStep answered, and that fuyoud SIGKILLed 5 s later: both ranks fail."""
    release = tmp_path / "release-syncs"
    release.write_text("")
    cut = run_ranks(tmp_path, 2, "--steps-to", "4", "--hold-commit-at", f"0:2:{release}", "--timeout", "20",
                    *flags, name="cut",
                    env_of=node_b_holding_syncs(tmp_path, "dp.rank0-of2", release))
    assert cut[0]["held_step"] == 3, cut[0]
    assert all("error" in r for r in cut), cut
    return cut


@pytest.mark.parametrize("gate", [True, False], ids=["gated", "no-gate"])
def test_a_fuyoud_killed_before_its_step_was_durable_leaves_every_rank_able_to_resume(
        tmp_path, gate):
    """Issue 24, "never lose a step": node b's fuyoud dies after answering
    EndStep 3 but before step 3 was durable there; rank 1 (node a) has step 3
    durable. With the durable gate, rank 1 raises before it sends any update of
    step 4 (whose write-backs go to the extents holding step 2), so the restart
    resumes both ranks at step 2 and matches torch. Without it (the hole),
    rank 1's step 4 updates overwrote step 2's states: the resume fails."""
    cut = _cut_before_step_3_is_durable_on_node_b(tmp_path, *([] if gate else ["--no-durable-gate"]))
    if gate:  # rank 1 raised before any send of step 4 (the gate's error, or gloo's
        # when rank 0 left first: which one depends on timing)
        assert cut[1]["committed_at_error"] == 3, cut[1]
        assert cut[1]["durable_gates"] == 2, cut[1]  # after steps 1 and 2
    again = run_ranks(tmp_path, 2, "--steps-from", "2", "--steps-to", "4", name="again",
                      env_of=node_b_holding_syncs(tmp_path, "dp.rank0-of2"))
    if not gate:
        print("without the gate:", [r.get("error") for r in again])
        assert all("error" in r for r in again), again
        return
    assert_matches_torch(again, 2)
    assert all(r["resumed"] and r["committed"] == 2 and r["start_violation"] <= 0.0
               for r in again), again
    assert all(r["durable_gates"] == 1 for r in again), again  # after step 3 (4 is the last)
