"""One rank of the resume, reshard and failure tests (test_dp_resume.py).

``dp_resume_worker.py RANK WORLD STORE OUT.json [--steps-from A] [--steps-to B]
[--history W0,W1,...] [--address ADDR] [--die-at RANK:STEP:POINT] [--timeout S]
[--hold-commit-at RANK:STEP:FILE] [--no-durable-gate] [--chunk-bytes N]``:
joins a gloo group of WORLD ranks over a FileStore (WORLD 1: a single process,
no torch.distributed), trains dp_worker.py's MLP with fuyou.AdamW on job "dp"
from step A to B on this rank's batches and compares every weight after each
step with torch.optim.AdamW run here on the gradients averaged over the ranks
of each step, where step i was trained with ``history[i]`` ranks (default:
WORLD for every step). ``--die-at RANK:STEP:POINT`` SIGKILLs rank RANK at STEP:
``backward`` (after backward), ``send`` (after its first chunk was handed to
the sender), ``before-end-step`` (after every rank agreed, before its own
EndStep), ``after-end-step`` (its step committed), ``reshard`` (after its
first imported chunk), ``marker`` (rank 0, after the reshard's marker job
was made, before the old jobs are deleted). ``--hold-commit-at RANK:STEP:FILE``
(rank RANK's embedded fuyoud runs with ``FUYOU_TEST_FAULTS=sync:HOLD:until=FILE``):
FILE is removed just before STEP's EndStep (a second after the step's last
update, for its write-backs' syncs), so the step's durable commit is held,
and that fuyoud is SIGKILLed 5 s after EndStep answered (dp_stream_worker.py's
``hold_commit``); ``--no-durable-gate``: _dp_durable.py's gate made a no-op
(the hole it closes). OUT.json gets the per-step violations, what the
optimizer saw, and an error's text with the seconds from the start of the
failing step to the error.
"""

import argparse
import datetime
import json
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

import dp_worker
import fuyou
import fuyou._dp_durable
import fuyou._reshard
from dp_stream_worker import hold_commit
from dp_worker import BETAS, EPS, LR, WD, batch, loss_of, make_model, violation


def reference(history):
    """Weights after each step: torch.optim.AdamW on the gradient averaged
    over the history[step] ranks of each step."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    out = []
    for step, world in enumerate(history):
        for r in range(world):
            (loss_of(model, *batch(step, r)) / world).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def resharded_from(opt):
    """The world size this start resharded from (None: it did not)."""
    dp = opt._data_parallel
    plan = dp.world_plan if dp is not None else opt._reshard_plan
    return plan.source_world if plan is not None else None


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def arm(opt, point, current_step):
    """Wraps the optimizer's pipeline so that `point` kills this process while
    current_step() is the chosen step (fault injection only; nothing else changes)."""
    pipeline = opt.pipeline
    if point == "send":
        send = pipeline.send

        def send_then_die(*a, **kw):
            send(*a, **kw)
            if current_step():
                pipeline.wait_sent()
                die()
        pipeline.send = send_then_die
    elif point in ("before-end-step", "after-end-step"):
        link = pipeline._link
        end_step = link.end_step

        def end_step_and_die():
            if current_step() and point == "before-end-step":
                die()
            end_step()
            if current_step():
                die()
        link.end_step = end_step_and_die


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rank", type=int)
    ap.add_argument("world", type=int)
    ap.add_argument("store")
    ap.add_argument("out")
    ap.add_argument("--steps-from", type=int, default=0)
    ap.add_argument("--steps-to", type=int, default=3)
    ap.add_argument("--history", default="")
    ap.add_argument("--address", default=None)
    ap.add_argument("--die-at", default="")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--hold-commit-at", default="")
    ap.add_argument("--no-durable-gate", action="store_true")
    ap.add_argument("--chunk-bytes", type=int, default=2048)  # 0: fuyou.AdamW's default
    args = ap.parse_args()
    if args.no_durable_gate:
        for name in ("before_writes", "start", "finish"):
            setattr(fuyou._dp_durable.DurableGate, name, lambda self, group=None: None)
    history = ([int(w) for w in args.history.split(",")] if args.history
               else [args.world] * args.steps_to)
    die_rank, die_step, die_point = args.die_at.split(":") if args.die_at else (-1, -1, "")
    die_step = int(die_step)
    if int(die_rank) != args.rank:
        die_point = ""
    result = {"rank": args.rank}
    if args.world > 1:
        store = dist.FileStore(args.store, args.world)
        dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world,
                                timeout=datetime.timedelta(seconds=args.timeout))
    if die_point in ("reshard", "marker"):  # after its first import / the marker made
        name = "_import" if die_point == "reshard" else "_make_marker"
        real = getattr(fuyou._reshard, name)

        def then_die(*a, **kw):
            real(*a, **kw)
            die()
        setattr(fuyou._reshard, name, then_die)
    opt = None
    step = args.steps_from
    started = time.monotonic()
    try:
        ref = reference(history[:args.steps_to])
        model = make_model()
        if args.steps_from > 0:  # a resumed job installs its weights; start elsewhere
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        opt = fuyou.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                          job="dp", address=args.address,
                          **({"chunk_bytes": args.chunk_bytes} if args.chunk_bytes else {}),
                          timeout=args.timeout)
        dp = opt._data_parallel
        result.update(job=opt.job, address=opt.address, resumed=opt.resumed,
                      committed=opt.committed_step, embedded=opt.embedded_daemon is not None,
                      own_chunks=opt.num_chunks,
                      all_chunks=len(dp.all_chunks) if dp is not None else opt.num_chunks,
                      resharded_from=resharded_from(opt))
        if args.steps_from > 0:
            result["start_violation"] = max(
                violation(a, b) for a, b in zip(ref[args.steps_from - 1], model.parameters()))
        if die_point:
            arm(opt, die_point, lambda: step == die_step)
        if args.hold_commit_at:
            hold_rank, hold_step, release = args.hold_commit_at.split(":", 2)
            if int(hold_rank) == args.rank:
                hold_commit(opt, int(hold_step), release, lambda: step, result)
        worst = []
        for step in range(args.steps_from, args.steps_to):
            started = time.monotonic()
            loss_of(model, *batch(step, args.rank)).backward()
            if step == die_step and die_point == "backward":
                die()
            opt.step()
            opt.zero_grad(set_to_none=True)
            worst.append(max(violation(a, b) for a, b in zip(ref[step], model.parameters())))
        result.update(worst=worst, final_committed=opt.committed_step,
                      durable_gates=opt.loop_stats.durable_gates,
                      durable_wait_seconds=opt.loop_stats.durable_wait_seconds)
        opt.close()
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        result["error_after_s"] = time.monotonic() - started
        result["error_step"] = step
        result["traceback"] = traceback.format_exc()
        if opt is not None:
            result["committed_at_error"] = opt.committed_step
            result["durable_gates"] = opt.loop_stats.durable_gates
            try:
                opt.close()
            except Exception:
                pass
    with open(args.out, "w") as f:
        json.dump(result, f)
    if args.world > 1:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


if __name__ == "__main__":
    dp_worker.exit_without_teardown(main())
