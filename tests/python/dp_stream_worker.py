"""One rank of test_dp_stream.py: offload_params=True and
fuyou.stream_parameters in a data-parallel job (_sharded_streamed.py).

``dp_stream_worker.py RANK WORLD STORE OUT.json [--steps-from A] [--steps-to B]
[--chunk-bytes N] [--accumulate] [--overflow-at S] [--load-torch]
[--clip opt|loop|none] [--halve-at S] [--no-overlap] [--declare-passes K]
[--hold-commit-at R:S:FILE] [--no-durable-gate] [--timeout T] [--edit-steps S,T]
[--edit-in-forward]``:
joins a gloo group over a FileStore and trains dp_worker.py's MLP, streamed
(its parameters are placeholders; each module's weights are fetched from the
rank's fuyoud), on this rank's batches from step A to B. ``--clip``: by
``max_grad_norm=`` (the default), by ``torch.nn.utils.clip_grad_norm_`` in the
loop after backward (on the averaged ``.grad``), or not at all; ``--halve-at
S``: ``p.grad.mul_(0.5)`` on every parameter before step S's clip;
``--no-overlap``: ``overlap=False``; ``--declare-passes K``:
``accumulation_steps=K`` (more than the loop makes: step() averages the
first step); ``--hold-commit-at R:S:FILE`` (rank R, whose embedded fuyoud
runs with ``FUYOU_TEST_FAULTS=sync:HOLD:until=FILE:...``): FILE is removed just
before step S's EndStep (after a second for the step's write-backs' syncs),
so the step's durable commit is held, and the embedded fuyoud is SIGKILLed 5
s later (a node's fuyoud crashing before its step was durable);
``--no-durable-gate``: the gate of _dp_durable.py made a no-op (the hole it
closes); ``--edit-steps``: dp_worker.edit_weights before those steps' forward
(a no_grad rescale and a .data clamp of the placeholders, on every rank);
``--edit-in-forward``: after the comparisons, rank 0 alone edits a weight
through ``.data`` inside a forward, which step() refuses on every rank; ``--timeout``: the process group's, in seconds (default 60). The
reduction counters (``opt._mode.reductions.counts``) and the pipeline's
speculative updates and redos go to the result.
After every step every weight, read with ``model.state_dict()`` (a local call),
is compared with torch.optim.AdamW run here on the averaged gradients of all
ranks' batches from step 0 (dp_worker.reference). Steps after the second use
``zero_grad()`` with torch 1.x's default (zeros, not None). ``--accumulate``:
two backward passes a step; ``--overflow-at S``: dynamic loss scaling, and an
inf in rank 1's loss at step S, which every rank skips; ``--load-torch``: torch.optim.AdamW's state dict at
step A loaded into the resumed job (each rank imports its chunks' moments; the
daemons keep the weights). At the end: the
optimizer's state dict (a collective), its export and its sharded export
(``shard_bytes=``, rank 0's directory) against torch's, and a
``model.state_dict()`` on rank 0 alone; then (not resumed) a
``model.load_state_dict`` on rank 0 alone, which the next step() refuses.
"""

import argparse
import copy
import dataclasses
import datetime
import json
import os
import signal
import threading
import time
import traceback

import torch
import torch.distributed as dist

import dp_worker
import fuyou
import fuyou._dp_durable
from dp_worker import (BETAS, EPS, LR, MAX_NORM, WD, batch, loss_of, make_model,
                       sharded_violations, violation)

CHUNK_BYTES = 1 << 16  # one chunk per Linear: 3 chunks, split 2 + 1 (by bytes)


def reference_states(steps: int, world: int, micro: int = 1, skipped: int = -1,
                     clip: bool = True, halve_at: int = -1, edit_steps=()):
    """torch.optim.AdamW's weights after each step and its state dict after the
    last; `micro` batches a step per rank; step `skipped` is not taken; the
    gradients halved at step `halve_at`."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    weights = []
    for step in range(steps):
        if step == skipped:
            weights.append([p.detach().clone() for p in model.parameters()])
            continue
        if step in edit_steps:
            dp_worker.edit_weights(model)
        for r in range(world):
            for m in range(micro):
                (loss_of(model, *batch(step, r, m)) / (world * micro)).backward()
        if step == halve_at:
            for p in model.parameters():
                p.grad.mul_(0.5)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        weights.append([p.detach().clone() for p in model.parameters()])
    return weights, copy.deepcopy(opt.state_dict())


def hold_commit(opt, hold_step, release, current_step, res):
    """At loop step `hold_step`: the step's durable commit is held on this
    rank's embedded fuyoud (FILE `release` removed before EndStep), which is
    SIGKILLed 5 s after EndStep answered."""
    link = opt._pipeline._link
    end_step = link.end_step
    daemon = opt.embedded_daemon

    def held_end_step():
        if current_step() != hold_step:
            return end_step()
        time.sleep(1.0)  # the step's write-backs and their syncs complete
        os.remove(release)
        end_step()
        res["held_step"] = link.committed

        def kill():
            time.sleep(5.0)  # the other ranks go as far as they can
            os.kill(daemon.pid, signal.SIGKILL)
        threading.Thread(target=kill, daemon=True).start()
    link.end_step = held_end_step


def edit_in_forward(model, opt, rank: int, step: int, res: dict) -> None:
    """Rank 0 alone edits model[2]'s fetched weights through .data inside its
    forward (a pre-hook): step() is refused on every rank, then goes on."""
    def shrink(module, args):
        module.weight.data.mul_(0.5)

    hook = model[2].register_forward_pre_hook(shrink) if rank == 0 else None
    loss_of(model, *batch(step, rank)).backward()
    if hook is not None:
        hook.remove()
    try:
        opt.step()
    except fuyou.FailedPrecondition as e:
        res["edit_in_forward"] = str(e)
    opt.step()  # said once
    opt.zero_grad(set_to_none=True)
    res["committed_after_edit"] = opt.committed_step


def main():
    ap = argparse.ArgumentParser()
    for name in ("rank", "world"):
        ap.add_argument(name, type=int)
    ap.add_argument("store")
    ap.add_argument("out")
    ap.add_argument("--steps-from", type=int, default=0)
    ap.add_argument("--steps-to", type=int, default=5)
    ap.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES)
    ap.add_argument("--accumulate", action="store_true")
    ap.add_argument("--overflow-at", type=int, default=-1)
    ap.add_argument("--load-torch", action="store_true")
    ap.add_argument("--clip", choices=("opt", "loop", "none"), default="opt")
    ap.add_argument("--halve-at", type=int, default=-1)
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--declare-passes", type=int, default=1)
    ap.add_argument("--hold-commit-at", default="")
    ap.add_argument("--no-durable-gate", action="store_true")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--edit-steps", default="")
    ap.add_argument("--edit-in-forward", action="store_true")
    args = ap.parse_args()
    edit_steps = [int(x) for x in args.edit_steps.split(",") if x]
    res = {"rank": args.rank}
    dist.init_process_group("gloo", store=dist.FileStore(args.store, args.world),
                            rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    if args.no_durable_gate:
        for name in ("before_writes", "start", "finish"):
            setattr(fuyou._dp_durable.DurableGate, name, lambda self, group=None: None)
    opt = None
    try:
        micro = 2 if args.accumulate else 1
        ref, ref_sd = reference_states(args.steps_to, args.world, micro, args.overflow_at,
                                       args.clip != "none", args.halve_at, edit_steps)
        model = make_model()
        if args.steps_from:  # a resumed job has the daemon's weights: start elsewhere
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        opt = fuyou.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                          job="s", chunk_bytes=args.chunk_bytes, max_grad_norm=MAX_NORM if args.clip == "opt" else None,
                          offload_params=True, overlap=not args.no_overlap,
                          accumulation_steps=args.declare_passes,
                          loss_scale="dynamic" if args.overflow_at >= 0 else None)
        ddp = torch.nn.parallel.DistributedDataParallel(make_model())  # a collective
        try:
            fuyou.stream_parameters(ddp, opt)
        except NotImplementedError as e:
            res["ddp"] = str(e)
        handle = fuyou.stream_parameters(model, opt, device_budget="1MiB", prefetch=1)
        dp = opt._data_parallel
        res.update(job=opt.job, resumed=opt.resumed, own_chunks=opt.num_chunks,
                   all_chunks=len(dp.all_chunks), placeholders=all(
                       p.numel() == 0 for p in model.parameters()))
        if args.steps_from:
            res["start"] = max(violation(a, b) for a, b in
                               zip(ref[args.steps_from - 1], model.state_dict().values()))
        if args.load_torch:  # torch.optim.AdamW's moments at the resumed step, imported
            opt.load_state_dict(reference_states(args.steps_from, args.world, micro)[1])
        if args.hold_commit_at:
            hold_rank, hold_step, release = args.hold_commit_at.split(":", 2)
            if int(hold_rank) == args.rank:
                hold_commit(opt, int(hold_step), release, lambda: step, res)
        worst = []
        for step in range(args.steps_from, args.steps_to):
            res["step"] = step
            if step in edit_steps:
                dp_worker.edit_weights(model)
            for m in range(micro):
                loss = loss_of(model, *batch(step, args.rank, m)) / micro
                if step == args.overflow_at and args.rank == 1:
                    loss = loss * float("inf")  # an inf on one rank skips the step on all
                opt.scale_loss(loss).backward()
            if step == args.halve_at:  # a uniform linear edit of the averaged .grad
                for p in model.parameters():
                    p.grad.mul_(0.5)
            if args.clip == "loop":  # the global norm: .grad holds the average
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            if step < 2:
                opt.zero_grad(set_to_none=True)
            else:
                opt.zero_grad()  # torch 1.x: zeros
            weights = list(model.state_dict().values())
            worst.append(max(violation(a, b) for a, b in zip(ref[step], weights)))
        sd = opt.state_dict()
        states = -1.0
        for i, st in ref_sd["state"].items():
            if float(sd["state"][i]["step"]) != float(st["step"]):
                states = float("inf")
            for key in ("exp_avg", "exp_avg_sq"):
                states = max(states, violation(st[key], sd["state"][i][key]))
        ck = opt.export_checkpoint(None, model)  # a collective: the whole job's masters
        export = max(violation(a, ck["model"][name]) for a, (name, _) in
                     zip(ref[args.steps_to - 1], model.named_parameters()))
        # the sharded export, a collective: rank 0 writes every rank's chunks
        sharded_dir = os.path.join(os.path.dirname(args.out), f"sharded-{args.steps_to}")
        fuyou.export_checkpoint(opt, sharded_dir, model, shard_bytes=1024)
        if args.rank == 0:
            res["sharded"] = sharded_violations(sharded_dir, [n for n, _ in model.named_parameters()],
                                                ref[args.steps_to - 1], ref_sd["state"])
        res.update(worst=worst, states=states, committed=opt.committed_step,
                   skipped=opt.skipped_steps, loss_scale=opt.loss_scale,
                   edits_taken=opt.offload.placeholders.edits_taken,
                   fetches=handle.fetches, export=export,
                   counts=dataclasses.asdict(opt._mode.reductions.counts),
                   speculative=opt._pipeline.stats.speculative_updates,
                   redone_changed=opt._pipeline.stats.redone_changed,
                   redone_clipped=opt._pipeline.stats.redone_clipped,
                   durable_gates=opt.loop_stats.durable_gates,
                   durable_wait_seconds=opt.loop_stats.durable_wait_seconds)
        dist.barrier()
        if args.rank == 0:  # a local call: no other rank takes part
            alone = list(model.state_dict().values())
            res["alone"] = max(violation(a, b) for a, b in zip(ref[args.steps_to - 1], alone))
        dist.barrier()
        if args.edit_in_forward:
            edit_in_forward(model, opt, args.rank, args.steps_to, res)
        if not args.steps_from:  # model.load_state_dict on rank 0 only: step() refuses
            if args.rank == 0:
                model.load_state_dict(model.state_dict())
            loss_of(model, *batch(args.steps_to, args.rank)).backward()
            try:
                opt.step()
            except fuyou.FailedPrecondition as e:
                res["uneven_load"] = str(e)
        opt.close()
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        if opt is not None:
            res["committed"] = opt.committed_step
            try:
                opt.close()
            except Exception as e:  # its fuyoud killed on purpose (--hold-commit-at)
                res["close_error"] = f"{type(e).__name__}: {e}"
        res["durable_gates"] = opt.loop_stats.durable_gates if opt is not None else 0
    with open(args.out, "w") as f:
        json.dump(res, f)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


if __name__ == "__main__":
    dp_worker.exit_without_teardown(main())
