"""One rank of test_dp_state_dict.py: the states of a data-parallel job read
and written as one (state_dict, load_state_dict, export_checkpoint,
opt.state[p], init_from), against torch.optim.AdamW.

``dp_state_worker.py RANK WORLD STORE OUT.json``: joins a gloo group over a
FileStore (the output's folder holds the files it saves), and on this rank's
batches (dp_worker.py's model, data and tolerance; clipping on):

- job "a": trains steps 0-2, then ``state_dict()`` on every rank, ``opt.state``,
  ``export_checkpoint`` with and without the model, the sharded export
  (``shard_bytes=``) of the whole job; rank 0 saves the state dict;
- torch.optim.AdamW loads that state dict and trains on to step 5 (the way back);
- job "b": a fresh job loads torch.optim.AdamW's own state dict of step 2;
- job "c": a fresh job loads the saved fuyou state dict;
- job "d": a fresh job starts from the export with ``init_from``;
- job "a" again: resumes at step 2 and loads its own state dict (no import);
- job "f": ``state_dict()`` on rank 0 alone, then on both; the ranks load
  different state dicts;
- job "g": a fresh job starts with ``init_from`` a sharded checkpoint, which
  rank 0 exported from a single-process job "single" trained on the global
  batch to step 2 before the group was formed;
- job "h": a fresh job starts with ``init_from`` job "a"'s sharded export.

Each continuation trains to step 5 and is compared after every step with
torch.optim.AdamW run here on the averaged gradients from step 0. Writes the
largest violations and what it saw to OUT.json.
"""

import copy
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import dp_worker
import fuyou
from dp_worker import (BETAS, EPS, LR, MAX_NORM, WD, batch, loss_of, make_model,
                       sharded_violations, violation)

SAVED, END = 2, 5
CHUNK_BYTES = 2048


def reference(world: int):
    """torch.optim.AdamW on the gradients averaged over `world` ranks' batches,
    clipped: the weights after each step and the state dicts after SAVED and END."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    weights, sds = [], {}
    for step in range(END):
        average_backward(model, step, world)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        weights.append([p.detach().clone() for p in model.parameters()])
        if step + 1 in (SAVED, END):
            sds[step + 1] = copy.deepcopy(opt.state_dict())
    return weights, sds


def average_backward(model, step: int, world: int) -> None:
    for r in range(world):
        (loss_of(model, *batch(step, r)) / world).backward()


def fuyou_opt(model, job: str, **kw):
    return fuyou.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                       job=job, chunk_bytes=CHUNK_BYTES, max_grad_norm=MAX_NORM, **kw)


def train(model, opt, rank: int, ref_weights) -> list:
    """Steps SAVED..END on this rank's batches; the violation after each."""
    worst = []
    for step in range(SAVED, END):
        loss_of(model, *batch(step, rank)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        worst.append(max(violation(a, b) for a, b in zip(ref_weights[step], model.parameters())))
    return worst


def state_violation(state: dict, ref_state: dict) -> float:
    """The largest violation over every parameter's exp_avg and exp_avg_sq; inf
    when the parameters or steps differ."""
    if sorted(state) != sorted(ref_state):
        return float("inf")
    worst = -1.0
    for i, ref in ref_state.items():
        if float(state[i]["step"]) != float(ref["step"]):
            return float("inf")
        for key in ("exp_avg", "exp_avg_sq"):
            worst = max(worst, violation(ref[key], state[i][key]))
    return worst


def start_violation(model, ref_weights) -> float:
    return max(violation(a, b) for a, b in zip(ref_weights[SAVED - 1], model.parameters()))


def error_of(fn) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def phase_a(rank, world, here: Path, ref_weights, ref_sds, res):
    model = make_model()
    opt = fuyou_opt(model, "a")
    for step in range(SAVED):
        loss_of(model, *batch(step, rank)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sd = opt.state_dict()  # every rank: a collective
    res["a_state"] = state_violation(sd["state"], ref_sds[SAVED]["state"])
    res["a_groups"] = [{k: g[k] for k in ("lr", "eps", "weight_decay")} for g in sd["param_groups"]]
    res["a_fuyou"] = {k: sd["fuyou"][k] for k in ("job", "data_parallel", "committed_step")}
    local, errors = [], []
    for i, p in enumerate(model.parameters()):
        try:
            st = opt.state[p]
        except fuyou.FailedPrecondition as e:
            errors.append(str(e))
            continue
        local.append(i)
        ref = ref_sds[SAVED]["state"][i]
        res.setdefault("a_local_state", -1.0)
        res["a_local_state"] = max(res["a_local_state"], violation(ref["exp_avg"], st["exp_avg"]),
                                   violation(ref["exp_avg_sq"], st["exp_avg_sq"]))
    res.update(a_local=local, a_iterated=sorted(
        i for i, p in enumerate(model.parameters()) if p in opt.state),
        a_len=len(opt.state), a_state_errors=errors)
    ck = opt.export_checkpoint(here / "export.pt", model)
    by_index = opt.export_checkpoint(here / "export_by_index.pt")
    res["a_export_state"] = state_violation(ck["optimizer"]["state"], ref_sds[SAVED]["state"])
    res["a_export_masters"] = max(violation(a, ck["model"][name]) for a, (name, _) in
                                  zip(ref_weights[SAVED - 1], model.named_parameters()))
    res["a_export_fuyou"] = ck["fuyou"]
    res["a_export_by_index"] = sorted(by_index["model"]) == list(range(len(ref_weights[0])))
    # the sharded export: a collective, rank 0 writes the whole job's shards
    summary = fuyou.export_checkpoint(opt, here / "dp_sharded", model, shard_bytes=1024)
    res["a_sharded_summary"] = {k: summary[k] for k in ("fuyou", "peak_bytes")}
    res["a_sharded_files"] = len(set(summary["weights"].values()))
    if rank == 0:
        res["a_sharded"] = sharded_violations(here / "dp_sharded", [n for n, _ in model.named_parameters()],
                                              ref_weights[SAVED - 1], ref_sds[SAVED]["state"])
    if rank == 0:
        torch.save(sd, here / "fuyou_sd.pt")
    weights = copy.deepcopy(model.state_dict())
    opt.close()
    dist.barrier()
    res["a_export_written"] = (here / "export.pt").exists()
    return weights


def torch_from_fuyou(world, here: Path, weights, ref_weights, res):
    """torch.optim.AdamW continues from the fuyou state dict (no collective)."""
    model = make_model()
    model.load_state_dict(weights)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    opt.load_state_dict(torch.load(here / "fuyou_sd.pt"))
    worst = []
    for step in range(SAVED, END):
        average_backward(model, step, world)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        worst.append(max(violation(a, b) for a, b in zip(ref_weights[step], model.parameters())))
    res["torch_from_fuyou"] = worst


def continued(rank, job, weights, ref_weights, ref_sds, load=None, **kw):
    """A data-parallel fuyou job from `weights` (None: the model's initial
    ones), `load` given to load_state_dict, trained to END: (violations,
    start violation, state violation at END)."""
    model = make_model()
    if weights is not None:
        model.load_state_dict(weights)
    opt = fuyou_opt(model, job, **kw)
    if load is not None:
        opt.load_state_dict(load)
    start = start_violation(model, ref_weights)
    worst = train(model, opt, rank, ref_weights)
    end = state_violation(opt.state_dict()["state"], ref_sds[END]["state"])
    opt.close()
    return {"worst": worst, "start": start, "end_state": end, "committed": opt.committed_step}


def phase_f(rank, weights, here: Path, res):
    model = make_model()
    model.load_state_dict(weights)
    opt = fuyou_opt(model, "f", timeout=3.0)
    if rank == 0:  # alone: an error after the timeout, not a wait in the collective
        res["f_alone"] = error_of(opt.state_dict)
    dist.barrier()
    res["f_after"] = error_of(opt.state_dict)  # together again: it works
    sd = torch.load(here / "fuyou_sd.pt")
    if rank == 1:
        first = next(iter(sd["state"].values()))
        first["exp_avg"].mul_(2)
    res["f_different"] = error_of(lambda: opt.load_state_dict(sd))
    bad = torch.load(here / "fuyou_sd.pt")
    if rank == 0:  # wrong on rank 0 only: rank 1 hears of it
        bad["state"][max(bad["state"])]["exp_avg"] = torch.zeros(3)
    res["f_bad_shape"] = error_of(lambda: opt.load_state_dict(bad))
    # job "a"'s state dict as saved over state_dict_max_bytes: no moments to import
    momentless = torch.load(here / "fuyou_sd.pt")
    momentless["state"] = {}
    momentless["fuyou"]["state_included"] = False
    res["f_momentless"] = error_of(lambda: opt.load_state_dict(momentless))
    res["f_state_untouched"] = len(opt.state) == 0  # nothing was imported
    opt.close()


def single_process_export(world: int, here: Path) -> None:
    """Job "single" trained on the global batch to step SAVED by one process
    (torch.distributed not initialised yet), exported as a sharded checkpoint."""
    model = make_model()
    opt = fuyou_opt(model, "single")
    for step in range(SAVED):
        average_backward(model, step, world)
        opt.step()
        opt.zero_grad(set_to_none=True)
    fuyou.export_checkpoint(opt, here / "sharded", model, shard_bytes=4096)
    opt.close()


def main():
    rank, world, store_path, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    here = Path(out).parent
    res = {"rank": rank}
    if rank == 0:  # the others wait in init_process_group
        single_process_export(world, here)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    try:
        ref_weights, ref_sds = reference(world)
        weights = phase_a(rank, world, here, ref_weights, ref_sds, res)
        torch_from_fuyou(world, here, weights, ref_weights, res)
        res["b"] = continued(rank, "b", weights, ref_weights, ref_sds,
                             load=copy.deepcopy(ref_sds[SAVED]))
        res["c"] = continued(rank, "c", weights, ref_weights, ref_sds,
                             load=torch.load(here / "fuyou_sd.pt"))
        res["d"] = continued(rank, "d", None, ref_weights, ref_sds,
                             init_from=str(here / "export_by_index.pt"))
        res["a_again"] = continued(rank, "a", None, ref_weights, ref_sds,
                                   load=torch.load(here / "fuyou_sd.pt"))
        phase_f(rank, weights, here, res)
        res["g"] = continued(rank, "g", None, ref_weights, ref_sds,
                             init_from=str(here / "sharded"))
        res["h"] = continued(rank, "h", None, ref_weights, ref_sds,
                             init_from=str(here / "dp_sharded"))
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
    with open(out, "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    dp_worker.exit_without_teardown(main())
