"""A training job for the resume test: trains the tiny GPT with fuyou.AdamW from
the job's committed step up to --steps, printing one line per committed step.
With --hang-at-step S it stops in the middle of step S (after backward has sent
chunks to the daemon, before step()) and waits to be killed."""

import argparse
import sys
import time

import torch

import fuyou
from helpers import make_model
from train_util import CHUNK_BYTES, split_groups, step_loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hang-at-step", type=int, default=-1)
    args = ap.parse_args()

    torch.set_num_threads(1)
    model = make_model()
    deadline = time.monotonic() + 10.0
    while True:  # the daemon may take a moment to notice a killed predecessor
        try:
            opt = fuyou.AdamW(split_groups(model), job=args.job, address=args.address,
                              chunk_bytes=CHUNK_BYTES, num_slots=3, timeout=20.0)
            break
        except fuyou.FailedPrecondition:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    print(f"opened resumed={opt.resumed} committed={opt.committed_step}", flush=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s),
                                              last_epoch=-1)
    for _ in range(opt.committed_step):  # the schedule position follows the job
        sched.step()
    for step in range(opt.committed_step, args.steps):
        step_loss(model, step).backward()
        if step + 1 == args.hang_at_step:
            print(f"mid-step {step + 1}", flush=True)
            time.sleep(600)
            sys.exit(3)
        opt.step()
        opt.zero_grad()
        sched.step()
        print(f"committed {opt.committed_step}", flush=True)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
    opt.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
