"""finetune_gpt.py --ddp: the example as one rank of a torchrun job.

    .venv/bin/python -m torch.distributed.run --nproc_per_node=2 \\
        python_client/examples/finetune_gpt.py --ddp --daemon embedded ...

``join`` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT), joins the process group (gloo on the CPU, nccl on CUDA, one
GPU per local rank) and records the rank in ``args``; ranks other than 0 print
nothing (their stdout goes to /dev/null; errors still reach stderr) and write
no outputs. fuyou.AdamW finds the group itself: each rank trains the job
``<job>.rank<r>-of<w>`` and owns whole chunks; the lowest rank of each node
finds the node's fuyoud (with ``--daemon embedded``, local rank 0 starts it and
the other ranks of the node are told its address). ``wrap`` puts the model in
DistributedDataParallel; fuyou sees that DDP averaged the gradients and does
not reduce them again (README "Data parallel"). With ``--ddp-model plain`` the
model is not wrapped and fuyou reduces each chunk to its owner during backward.

torch 1.13's torchrun on Python 3.11 fails before it starts a rank
(``AttributeError: 'NoneType' object has no attribute 'get'``: its
``Std.from_str`` finds no member for its own defaults "0" of ``--redirects`` and
``--tee``); ``--redirects 9:1 --tee 9:1`` (a local rank 9 that a job of fewer
ranks does not have) avoids it, as deploy/main-job.sh --ddp does.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["join", "leave", "wrap", "is_main", "node_leader", "rank_seed", "world_size"]


def join(args) -> None:
    """Joins torchrun's process group; sets args.rank, args.world_size,
    args.local_rank (and args.device to this rank's GPU on CUDA)."""
    import torch.distributed as dist
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        sys.exit(f"error: --ddp runs under torchrun (.venv/bin/python -m torch.distributed.run "
                 f"--nproc_per_node=N ...), which sets {', '.join(missing)}")
    args.rank, args.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    args.local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(args.local_rank)
        args.device = f"cuda:{args.local_rank}"
    dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    if args.rank != 0:
        args.no_progress = True
        sys.stdout = open(os.devnull, "w")


def leave(args) -> None:
    import torch.distributed as dist
    if getattr(args, "ddp", False) and dist.is_initialized():
        dist.destroy_process_group()


def wrap(model, args):
    """The model to train: DistributedDataParallel over it with --ddp (unless
    --ddp-model plain: fuyou.AdamW reduces the gradients itself, during backward)."""
    if not getattr(args, "ddp", False) or getattr(args, "ddp_model", "ddp") == "plain":
        return model
    ids = [args.local_rank] if args.device.startswith("cuda") else None
    # gloo broadcasts no bool tensors: the attention masks (the same on every
    # rank, built from the config) are left out of DDP's start-up broadcast.
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, [name for name, b in model.named_buffers() if b.dtype == torch.bool])
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def is_main(args) -> bool:
    """Whether this process prints and writes the outputs (rank 0, or no --ddp)."""
    return getattr(args, "rank", 0) == 0


def node_leader(args) -> bool:
    """Whether this process starts the node's embedded fuyoud (local rank 0)."""
    return getattr(args, "local_rank", 0) == 0


def rank_seed(seed: int, args) -> int:
    """The batches' seed of this rank: each rank draws its own batches."""
    return seed + 1000 * getattr(args, "rank", 0)


def world_size(args) -> int:
    return getattr(args, "world_size", 1)
