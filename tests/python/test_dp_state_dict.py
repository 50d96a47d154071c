"""state_dict, load_state_dict, export_checkpoint, opt.state[p] and init_from
of a data-parallel fuyou.AdamW (issue 24; python_client/fuyou/_sharded_states.py):
two real gloo ranks (dp_state_worker.py) sharing one embedded fuyoud, against
torch.optim.AdamW on the averaged, clipped gradients, both ways round."""

from __future__ import annotations

from dp_ranks import run_worker

STEPS_AFTER_LOAD = 3  # SAVED=2 .. END=5 in the worker


def _within(values) -> bool:
    return len(values) == STEPS_AFTER_LOAD and max(values) <= 0.0


def test_state_dict_export_load_and_init_from_round_trip_with_two_ranks(tmp_path):
    results = run_worker("dp_state_worker.py", tmp_path, 2)
    for res in results:
        r = res["rank"]
        # the full state dict on every rank, torch.optim.AdamW's states at step 2
        assert res["a_state"] <= 0.0, (r, res["a_state"])
        assert res["a_fuyou"] == {"job": "a", "data_parallel": {"world_size": 2},
                                  "committed_step": 2}
        # export_checkpoint: the whole job on every rank, one file by rank 0
        assert res["a_export_state"] <= 0.0 and res["a_export_masters"] <= 0.0, res
        assert res["a_export_fuyou"]["job"] == "a" and res["a_export_by_index"]
        assert res["a_export_written"]
        # torch.optim.AdamW continues from fuyou's state dict
        assert _within(res["torch_from_fuyou"]), res["torch_from_fuyou"]
        # the sharded export of the whole job, written by rank 0 (1 KiB shards)
        assert res["a_sharded_summary"]["fuyou"] == {"job": "a", "committed_step": 2,
                                                     "data_parallel": {"world_size": 2}}
        assert res["a_sharded_files"] > 1, res
        if r == 0:
            assert max(res["a_sharded"]) <= 0.0, res["a_sharded"]  # weights, moments
        # fresh jobs from torch's state dict, from fuyou's, from the export, from
        # a single-process job's sharded export and from the data-parallel one
        for phase in ("b", "c", "d", "g", "h"):
            got = res[phase]
            assert _within(got["worst"]), (r, phase, got)
            assert got["start"] <= 0.0 and got["end_state"] <= 0.0, (r, phase, got)
            assert got["committed"] == STEPS_AFTER_LOAD, (r, phase, got)
        # the job itself resumed at step 2 and its own state dict: nothing imported
        again = res["a_again"]
        assert again["start"] <= 0.0 and _within(again["worst"]), again
        assert again["end_state"] <= 0.0 and again["committed"] == 5, again
        # state_dict() on rank 0 alone: an error naming the habit, then both work
        if r == 0:
            assert "is a collective: only 1 of the 2 ranks called it" in res["f_alone"], res
            assert "if rank == 0: torch.save(sd, path)" in res["f_alone"]
        assert res["f_after"] == "", res["f_after"]
        # different state dicts on the ranks: refused on every rank, nothing written
        assert "the ranks loaded different state dicts" in res["f_different"], res
        # a wrong shape on rank 0 raises on every rank, before anything is written
        assert "has shape (3,)" in res["f_bad_shape"], res["f_bad_shape"]
        assert ("InvalidArgument" if r == 0 else "another rank failed: rank 0: "
                "InvalidArgument") in res["f_bad_shape"], res["f_bad_shape"]
        assert res["f_state_untouched"]
        # another job's state dict without moments: says how to move them instead
        assert "NotImplementedError" in res["f_momentless"], res["f_momentless"]
        assert "shard_bytes=" in res["f_momentless"] and "init_from" in res["f_momentless"]
    # opt.state is each rank's own: disjoint, covering the parameters not split
    # between the ranks; another rank's parameter raises, naming its owner
    locals_ = [set(res["a_local"]) for res in results]
    assert not (locals_[0] & locals_[1]) and locals_[0] and locals_[1]
    for res in results:
        assert res["a_iterated"] == res["a_local"] and res["a_len"] == len(res["a_local"])
        assert res["a_state_errors"], res
        assert all("opt.state holds this rank's parameters only" in e and "in the job of rank"
                   in e for e in res["a_state_errors"])
        assert len(res["a_local"]) + len(res["a_state_errors"]) == 6
