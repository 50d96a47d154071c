"""A training job for the resume test: trains the tiny GPT with fuyou.AdamW from
the job's committed step up to --steps, printing one line per committed step.
With --hang-at-step S it stops in the middle of step S (after backward has sent
chunks to the daemon, before step()) and waits to be killed. With --offload it
trains train_util.StreamGPT through fuyou.stream_parameters (offload_params)
and saves the daemon's weights (export_checkpoint) instead of the model's."""

import argparse
import sys
import time

import torch

import fuyou
from helpers import make_model
from train_util import CHUNK_BYTES, StreamGPT, split_groups, step_loss, stream_batch

STREAM_BUDGET = "32KiB"


def _schedule(s):
    return 1.0 / (1.0 + 0.1 * s)


def torch_reference(steps: int, offload: bool = True):
    """The worker's run fully resident with torch.optim.AdamW: the parameters in
    the optimizer's order (export_checkpoint's parameter indices)."""
    torch.manual_seed(0)
    model = StreamGPT(n_layer=2)
    opt = torch.optim.AdamW(split_groups(model))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    for step in range(steps):
        model(*stream_batch(step)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return [p for g in opt.param_groups for p in g["params"]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hang-at-step", type=int, default=-1)
    ap.add_argument("--offload", action="store_true")
    args = ap.parse_args()

    torch.set_num_threads(1)
    if args.offload:
        torch.manual_seed(0)
        model = StreamGPT(n_layer=2)
    else:
        model = make_model()
    deadline = time.monotonic() + 10.0
    while True:  # the daemon may take a moment to notice a killed predecessor
        try:
            opt = fuyou.AdamW(split_groups(model), job=args.job, address=args.address,
                              chunk_bytes=CHUNK_BYTES, num_slots=3, timeout=20.0,
                              offload_params=args.offload)
            break
        except fuyou.FailedPrecondition:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    if args.offload:
        fuyou.stream_parameters(model, opt, device_budget=STREAM_BUDGET)
    print(f"opened resumed={opt.resumed} committed={opt.committed_step}", flush=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule, last_epoch=-1)
    for _ in range(opt.committed_step):  # the schedule position follows the job
        sched.step()
    for step in range(opt.committed_step, args.steps):
        if args.offload:
            model(*stream_batch(step)).backward()
        else:
            step_loss(model, step).backward()
        if step + 1 == args.hang_at_step:
            print(f"mid-step {step + 1}", flush=True)
            time.sleep(600)
            sys.exit(3)
        opt.step()
        opt.zero_grad()
        sched.step()
        print(f"committed {opt.committed_step}", flush=True)
    if args.offload:  # the parameters are placeholders: the weights are in the daemon
        torch.save(opt.export_checkpoint()["model"], args.out)
    else:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
    opt.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
