"""One rank of the data-parallel tests (test_data_parallel.py).

``dp_worker.py RANK WORLD STORE OUT.json [--ddp] [--find-unused] [--clip] [--accumulate]
[--steps-from A --steps-to B] [--job J] [--chunk-bytes N] [--head-only-step K]
[--head-only-rank R] [--job-of-rank] [--drop-grad-steps S,T]``: joins a gloo
group over a FileStore, trains a small MLP with fuyou.AdamW on this rank's
batches from step A to B and compares, after every step, every weight with
torch.optim.AdamW run in this one process on the gradients averaged over all
ranks' batches (what 2-rank DDP + torch.optim.AdamW gives), from step 0.
Writes the largest violation of |a-b| <= 1e-6 + 1e-5|a| per step and what the
optimizer saw (job, address, embedded daemon, chunks) to OUT.json; an error's
text goes there too. With ``--head-only-step K`` step K's loss reaches only the
last layer (the others' chunks, and so some ranks' whole shards, get no
gradient in that step); with ``--head-only-rank R`` rank R's loss does so at
every step (parameters unused on one rank, as DDP's
``find_unused_parameters=True``, which ``--find-unused`` sets, is for); with
``--drop-grad-steps`` those steps set ``.grad = None`` after backward on two
parameters (the same on every rank: they skip the step, as in torch).
"""

import argparse
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

import fuyou

# eps near the clipped gradients' size: Adam is otherwise blind to a clip's scale
LR, BETAS, EPS, WD, MAX_NORM = 1e-2, (0.9, 0.99), 1e-3, 0.1, 0.05


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4))


def batch(step: int, rank: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


class HeadOnlySwitch(torch.nn.Module):
    """make_model()'s Sequential whose forward takes `head_only` (loss_of's), so
    that DDP sees the parameters a head-only forward leaves unused."""

    def __init__(self, seq):
        super().__init__()
        self.seq = seq

    def forward(self, x, head_only=False):
        if not head_only:
            return self.seq(x)
        with torch.no_grad():
            features = self.seq[:-1](x)
        return self.seq[-1](features)


def loss_of(model, x, y, head_only=False):
    """The loss of the batch; `head_only`: the layers before the last are run
    without autograd, so only the last layer gets gradients."""
    if isinstance(getattr(model, "module", None), HeadOnlySwitch):  # DDP over it
        return torch.nn.functional.mse_loss(model(x, head_only=head_only), y)
    if not head_only:
        return torch.nn.functional.mse_loss(model(x), y)
    with torch.no_grad():
        features = model[:-1](x)
    return torch.nn.functional.mse_loss(model[-1](features), y)


def edit_weights(model) -> None:
    """Edits outside step() (the same on every rank): a no_grad rescale and a
    WGAN clamp through .data."""
    with torch.no_grad():
        model[2].weight.mul_(0.5)
    for p in model.parameters():
        p.data.clamp_(-0.2, 0.2)


def drop_grads(model) -> None:
    """``p.grad = None`` after backward: these parameters skip this step."""
    model[2].bias.grad = None
    model[0].weight.grad = None


def reference(steps: int, world: int, clip: bool, micro: int, head_only_step: int = -1,
              head_only_rank: int = -1, edit_steps=(), drop_steps=(), state_out=None):
    """Weights after each step: torch.optim.AdamW on the averaged gradient
    (`state_out`: a list that gets the optimizer's per-parameter step counts)."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    out = []
    for step in range(steps):
        if step in edit_steps:
            edit_weights(model)
        for r in range(world):
            for m in range(micro):
                loss = loss_of(model, *batch(step, r, m),
                               head_only=step == head_only_step or r == head_only_rank)
                (loss / (world * micro)).backward()
        if step in drop_steps:
            drop_grads(model)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append([p.detach().clone() for p in model.parameters()])
    if state_out is not None:
        state_out.extend(_step_counts(opt.state_dict()))
    return out


def _step_counts(state_dict) -> list:
    """Each parameter's step count in an optimizer state dict (0: no state)."""
    state = state_dict["state"]
    return [int(state[i]["step"]) if i in state else 0
            for i in range(len(state_dict["param_groups"][0]["params"]))]


def exit_without_teardown(code) -> None:
    """Ends a rank once its result file is written and its process group
    destroyed, skipping the interpreter's teardown: torch's gloo threads can
    abort that teardown with "terminate called without an active exception"
    (pytorch/pytorch#190489), which says nothing about the rank's training.
    A crash before this point still fails the test (dp_ranks.py)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def violation(a: torch.Tensor, b: torch.Tensor) -> float:
    """max(|a-b| - (1e-6 + 1e-5|a|)): <= 0 within the tolerance."""
    return float(((a - b).abs() - (1e-6 + 1e-5 * a.abs())).max())


def sharded_violations(directory, names, ref_weights, ref_state) -> tuple:
    """A sharded checkpoint in `directory` against torch: the largest violation
    of its weights (`names`: the model's parameter names, in the order of
    `ref_weights`) and of its moments (`ref_state`: torch.optim.AdamW's
    state_dict()["state"]); inf for a tensor or a step count missing."""
    from fuyou._sharded import ShardReader
    reader = ShardReader(directory)
    try:
        weights = max(violation(ref, reader.tensor(name)) if reader.has(name) else float("inf")
                      for name, ref in zip(names, ref_weights))
        steps = reader.optimizer_meta["steps"]
        states = -1.0
        for i, ref in ref_state.items():
            if int(steps.get(str(i), 0)) != int(ref["step"]):
                return weights, float("inf")
            for key in ("exp_avg", "exp_avg_sq"):
                states = max(states, violation(ref[key], reader.moments.get(f"state.{i}.{key}")))
        return weights, states
    finally:
        reader.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rank", type=int)
    ap.add_argument("world", type=int)
    ap.add_argument("store")
    ap.add_argument("out")
    ap.add_argument("--ddp", action="store_true")
    ap.add_argument("--clip", action="store_true")
    ap.add_argument("--accumulate", action="store_true")
    ap.add_argument("--steps-from", type=int, default=0)
    ap.add_argument("--steps-to", type=int, default=3)
    ap.add_argument("--job", default="dp")
    ap.add_argument("--chunk-bytes", type=int, default=2048)  # 0: fuyou.AdamW's default
    ap.add_argument("--edit-steps", default="")  # weights edited before these steps: "0,2"
    ap.add_argument("--edit-only-rank", type=int, default=-1)  # that rank alone edits
    ap.add_argument("--head-only-step", type=int, default=-1)
    ap.add_argument("--head-only-rank", type=int, default=-1)
    ap.add_argument("--find-unused", action="store_true")
    ap.add_argument("--job-of-rank", action="store_true")  # job J<rank>: ranks disagree
    ap.add_argument("--drop-grad-steps", default="")  # .grad = None after backward: "1"
    args = ap.parse_args()
    edit_steps = [int(x) for x in args.edit_steps.split(",") if x]
    drop_steps = [int(x) for x in args.drop_grad_steps.split(",") if x]
    result = {"rank": args.rank}
    store = dist.FileStore(args.store, args.world)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
    opt = None
    try:
        micro = 2 if args.accumulate else 1
        ref_steps = []
        ref = reference(args.steps_to, args.world, args.clip, micro, args.head_only_step,
                        args.head_only_rank, edit_steps, drop_steps, ref_steps)
        model = make_model()
        if args.steps_from > 0:  # a resumed job installs its weights; start elsewhere
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        trained = (torch.nn.parallel.DistributedDataParallel(
            HeadOnlySwitch(model), find_unused_parameters=args.find_unused) if args.ddp else model)
        opt = fuyou.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                          job=args.job + (str(args.rank) if args.job_of_rank else ""),
                          **({"chunk_bytes": args.chunk_bytes} if args.chunk_bytes else {}),
                          max_grad_norm=MAX_NORM if args.clip else None)
        dp = opt._data_parallel
        result.update(job=opt.job, address=opt.address, resumed=opt.resumed,
                      committed=opt.committed_step, embedded=opt.embedded_daemon is not None,
                      own_chunks=opt.num_chunks, all_chunks=len(dp.all_chunks))
        if args.steps_from > 0:
            result["start_violation"] = max(
                violation(a, b) for a, b in zip(ref[args.steps_from - 1], model.parameters()))
        worst = []
        for step in range(args.steps_from, args.steps_to):
            if step in edit_steps and args.edit_only_rank in (-1, args.rank):
                edit_weights(model)
            for m in range(micro):
                head_only = step == args.head_only_step or args.rank == args.head_only_rank
                loss = loss_of(trained, *batch(step, args.rank, m), head_only=head_only) / micro
                if args.ddp and m < micro - 1:
                    with trained.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            if step in drop_steps:
                drop_grads(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
            worst.append(max(violation(a, b) for a, b in zip(ref[step], model.parameters())))
        result.update(worst=worst, steps_averaged=dp.steps_averaged,
                      final_committed=opt.committed_step)
        # the whole job's state dict on every rank (a collective: test_dp_state_dict.py)
        sd = opt.state_dict()
        result["state_dict_states"] = len(sd["state"])
        result["step_counts"], result["torch_step_counts"] = _step_counts(sd), ref_steps
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
    exit_without_teardown(main())
