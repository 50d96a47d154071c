"""An HF-Trainer-shaped run for test_optimizer_state_dict.py: the tiny GPT in
two parameter groups (train_util.split_groups), warm-up then cosine LambdaLR,
gradient accumulation 2, clip_grad_norm_(..., 1.0), in Trainer's order.

``run(model, opt, sched, first, last)`` trains steps first..last-1 and returns
the weights after each step. Run as a script it is the resumed half in a new
process: it builds the model and an optimizer (``--into fuyou`` or ``torch``),
loads model.pt, optimizer.pt and scheduler.pt from ``--dir`` as a resumed
Trainer does, trains ``--steps`` more steps and saves the weights after each
to ``--out``."""

from __future__ import annotations

import argparse
import math

import torch

from helpers import make_model
from train_util import CHUNK_BYTES, split_groups, step_loss

ACCUMULATION = 2
MAX_NORM = 1.0
WARMUP, TOTAL = 3, 12


def lr_lambda(step):
    if step < WARMUP:
        return (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, TOTAL - WARMUP)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(kind, model, address=None, job=None):
    if kind == "torch":
        return torch.optim.AdamW(split_groups(model))
    import fuyou
    return fuyou.AdamW(split_groups(model), job=job, address=address, chunk_bytes=CHUNK_BYTES,
                       num_slots=3, timeout=20.0)


def run(model, opt, sched, first, last):
    weights = []
    for step in range(first, last):
        for i in range(ACCUMULATION):
            (step_loss(model, step, micro=(ACCUMULATION, i)) / ACCUMULATION).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        sched.step()
        model.zero_grad()
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return weights


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--into", choices=["fuyou", "torch"], required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--first", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--address")
    ap.add_argument("--job")
    args = ap.parse_args()
    torch.set_num_threads(1)

    model = make_model()
    model.load_state_dict(torch.load(f"{args.dir}/model.pt"))  # the weights first, as Trainer
    opt = make_optimizer(args.into, model, args.address, args.job)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    opt.load_state_dict(torch.load(f"{args.dir}/optimizer.pt"))
    sched.load_state_dict(torch.load(f"{args.dir}/scheduler.pt"))
    weights = run(model, opt, sched, args.first, args.first + args.steps)
    torch.save(weights, args.out)
    if args.into == "fuyou":
        opt.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
