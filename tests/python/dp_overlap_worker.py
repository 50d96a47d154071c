"""One rank of the overlap tests (test_dp_overlap.py).

``dp_overlap_worker.py RANK WORLD STORE OUT.json [--ddp] [--clip] [--loop-clip]
[--micro K] [--declare] [--no-overlap] [--edit-grads] [--loss-scale] [--inf-at S]
[--solo] [--steps N]``: joins a gloo group over a FileStore and trains
dp_worker.py's MLP with fuyou.AdamW on this rank's batches, comparing every
weight after every step with torch.optim.AdamW run here on the averaged
gradient (what DDP + torch.optim.AdamW gives). Records, per step, the
reduction counters (``opt._mode.reductions.counts``) after each backward pass
(before step()) and after step(), and a digest of ``.grad`` after the last
backward pass (the same on every rank: fuyou wrote the average into it).
``--clip``: ``max_grad_norm``; ``--loop-clip``: ``clip_grad_norm_`` in the
loop between backward and step(), fuyou not clipping; ``--edit-apart``: rank
0 alone halves its gradients before step() (every rank must raise);
``--micro K``: K backward passes a step (``--declare``:
``accumulation_steps=K``; ``--accumulation-steps N``: declares N instead);
``--edit-grads``: every gradient halved between backward and step();
``--inf-at S``: rank 1's backward puts an inf into its gradient of the last
layer (a chunk rank 0 owns) in step S (loss scaling skips the step on every
rank); ``--drop-last R,..``: on those ranks the last parameter takes no part
in backward (no gradient: averaged with zeros, as DDP does; None on every
rank when every rank drops it); ``--no-overlap-rank R``: overlap off on rank R alone; ``--log-loss``: the
loss all-reduced on the default group between backward and step();
``--pause-in-backward``: every rank waits for the others, then half a
second, before the first layer's gradient; ``--skip-ddp-allreduce``: DDP reduces nothing (fuyou.skip_ddp_allreduce);
``--solo``: ``process_group=False``,
each rank a single-process job on its own daemon, against torch on its own
batches.
"""

import argparse
import dataclasses
import json
import os
import time
import traceback

import torch
import torch.distributed as dist

import dp_worker
import fuyou
from dp_worker import BETAS, EPS, LR, MAX_NORM, WD, batch, loss_of, make_model, violation


def reference(args, world: int, ranks):
    """Weights after each step: torch.optim.AdamW on the mean gradient of
    `ranks`' batches (skipped steps leave them as they are); the last
    parameter's gradient of the ranks in --drop-last left out (zeros, as DDP
    does; None when every rank drops it: torch does not update it)."""
    model = make_model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    out = []
    for step in range(args.steps):
        if step != args.inf_at:
            total = [None] * len(params)
            for r in ranks:
                opt.zero_grad(set_to_none=True)
                for m in range(args.micro):
                    (loss_of(model, *batch(step, r, m)) / (len(ranks) * args.micro)).backward()
                for i, p in enumerate(params):
                    if i == len(params) - 1 and r in args.drop_last:
                        continue
                    total[i] = p.grad.clone() if total[i] is None else total[i] + p.grad
            for p, g in zip(params, total):
                p.grad = g
            if args.edit_grads:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(0.5)
            if args.clip or args.loop_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
        opt.zero_grad(set_to_none=True)
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def digest(params) -> list:
    """[sum, sum of squares] of every .grad (fp64), None for a parameter without."""
    return [None if p.grad is None else [float(p.grad.double().sum()),
                                         float(p.grad.double().square().sum())] for p in params]


def counts_of(opt) -> dict:
    reductions = getattr(opt._mode, "reductions", None)
    return dataclasses.asdict(reductions.counts) if reductions is not None else {}


def main():
    ap = argparse.ArgumentParser()
    for name in ("rank", "world"):
        ap.add_argument(name, type=int)
    ap.add_argument("store")
    ap.add_argument("out")
    for flag in ("--ddp", "--clip", "--loop-clip", "--edit-apart", "--declare",
                 "--no-overlap", "--edit-grads",
                 "--loss-scale", "--solo", "--log-loss", "--skip-ddp-allreduce",
                 "--pause-in-backward"):
        ap.add_argument(flag, action="store_true")
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--accumulation-steps", type=int, default=0)
    ap.add_argument("--no-overlap-rank", type=int, default=-1)
    ap.add_argument("--inf-at", type=int, default=-1)
    ap.add_argument("--drop-last", type=lambda v: [int(r) for r in v.split(",")], default=[])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--chunk-bytes", type=int, default=2048)
    args = ap.parse_args()
    result = {"rank": args.rank}
    dist.init_process_group("gloo", store=dist.FileStore(args.store, args.world),
                            rank=args.rank, world_size=args.world)
    opt = None
    try:
        ranks = [args.rank] if args.solo else list(range(args.world))
        ref = reference(args, args.world, ranks)
        model = make_model()
        trained = torch.nn.parallel.DistributedDataParallel(model) if args.ddp else model
        if args.skip_ddp_allreduce:
            fuyou.skip_ddp_allreduce(trained)
        extra = {}
        if args.solo:  # each rank alone: its own job and its own embedded daemon
            os.environ["FUYOU_DATA_DIR"] = os.environ["FUYOU_DATA_DIR"] + f".solo{args.rank}"
            os.environ["FUYOU_SOCKET"] = os.environ["FUYOU_SOCKET"] + f".solo{args.rank}"
            extra["process_group"] = False
        opt = fuyou.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                          job=f"solo{args.rank}" if args.solo else "ov",
                          chunk_bytes=args.chunk_bytes,
                          overlap=not args.no_overlap and args.rank != args.no_overlap_rank,
                          max_grad_norm=MAX_NORM if args.clip else None,
                          accumulation_steps=args.accumulation_steps or (
                              args.micro if args.declare else 1),
                          loss_scale="dynamic" if args.loss_scale else None, **extra)
        dp = opt._data_parallel
        if args.pause_in_backward:  # before the first layer's gradient: every rank has
            def pause(grad):  # started the last layers' reductions; they end meanwhile
                dist.barrier()
                time.sleep(0.5)
                return grad
            model[0].weight.register_hook(pause)
        result.update(job=opt.job, data_parallel=dp is not None,
                      all_chunks=len(dp.all_chunks) if dp else opt.num_chunks,
                      own_chunks=opt.num_chunks)
        params = list(model.parameters())
        last, dropping = params[-1], args.rank in args.drop_last
        worst, per_step = [], []
        for step in range(args.steps):
            seen = []
            inf_hook = None
            if step == args.inf_at and args.rank == 1:
                # in the last layer, a chunk rank 0 owns: an inf in rank 1's own
                # gradient, which the average brings to every rank
                def put_inf(grad):
                    grad = grad.clone()
                    grad[0] = float("inf")
                    return grad
                inf_hook = last.register_hook(put_inf)
            for m in range(args.micro):
                last.requires_grad_(not dropping)  # no part in backward: no gradient
                loss = opt.scale_loss(loss_of(trained, *batch(step, args.rank, m)) / args.micro)
                if args.ddp and m < args.micro - 1:
                    with trained.no_sync():
                        loss.backward()
                else:
                    loss.backward()
                last.requires_grad_(True)
                seen.append(counts_of(opt))
            if inf_hook is not None:
                inf_hook.remove()
            grads = digest(params)
            if args.edit_grads:
                for p in model.parameters():
                    p.grad.mul_(0.5)
            if args.edit_apart and args.rank == 0:
                for p in model.parameters():
                    p.grad.mul_(0.5)
            if args.loop_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            if args.log_loss:  # the loop's own collective between backward and step()
                dist.all_reduce(loss.detach().clone())
            opt.step()
            opt.zero_grad(set_to_none=True)
            per_step.append({"after_pass": seen, "after_step": counts_of(opt), "grads": grads})
            worst.append(max(violation(a, b) for a, b in zip(ref[step], model.parameters())))
        result.update(worst=worst, per_step=per_step, skipped=opt.skipped_steps,
                      committed=opt.committed_step,
                      steps_averaged=dp.steps_averaged if dp else None,
                      speculative=opt.loop_stats.speculative_updates)
        opt.close()
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
        if opt is not None:
            opt.close()
    with open(args.out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    dp_worker.exit_without_teardown(main())
