"""The host-memory test of fuyou.materialize, in a process of its own: builds a
stack of Linear layers in init_empty, materializes it into an offload_params job
(init), trains it one step through stream_parameters (so that it has moments),
exports it as a sharded checkpoint, and materializes it again from that
checkpoint into a new job (weights and optimizer states). Before each phase it resets the process's peak RSS
(/proc/self/clear_refs 5) and prints, as one JSON line, how far each phase raised
it above the RSS it started from."""

import argparse
import gc
import json

import torch
import torch.nn as nn

import fuyou
from fuyou._shard_files import release_freed_memory


def rss() -> int:
    return _status("VmRSS:")


def peak() -> int:
    return _status("VmHWM:")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


class Phase:
    """Peak RSS growth over the RSS at entry."""

    def __enter__(self):
        gc.collect()
        release_freed_memory()  # what the last phase freed leaves the RSS first
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        self.start = rss()
        return self

    def __exit__(self, *exc):
        self.growth = peak() - self.start


def build(layers: int, width: int, job: str) -> nn.Module:
    with fuyou.init_empty(job=job):
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def init(module):
    for p in module.parameters(recurse=False):
        p.normal_(0.0, 0.02)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--shard-bytes", type=int, default=8 << 20)
    ap.add_argument("--checkpoint", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = {}

    model = build(args.layers, args.width, args.job)
    out["model_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    out["largest_module_bytes"] = max(
        sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
        for m in model.modules())
    opt = fuyou.AdamW(model.parameters(), lr=1e-3, job=args.job, address=args.address,
                      offload_params=True, timeout=60.0)
    with Phase() as phase:
        torch.manual_seed(0)
        fuyou.materialize(model, opt, init=init)
    out["materialize_init"] = phase.growth
    with Phase() as phase:
        handle = fuyou.stream_parameters(model, opt, device_budget=4 * out["largest_module_bytes"])
        x = torch.randn(8, args.width, generator=torch.Generator().manual_seed(0))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        handle.close()
    out["train_step"] = phase.growth
    with Phase() as phase:
        fuyou.export_checkpoint(opt, args.checkpoint, model=model, shard_bytes=args.shard_bytes)
    out["export_sharded"] = phase.growth
    opt.close()

    again = build(args.layers, args.width, args.job + "-again")
    opt2 = fuyou.AdamW(again.parameters(), lr=1e-3, job=args.job + "-again",
                       address=args.address, offload_params=True, timeout=60.0)
    with Phase() as phase:
        fuyou.materialize(again, opt2, checkpoint=args.checkpoint)
    out["materialize_checkpoint"] = phase.growth
    opt2.close()
    stats = fuyou.admin_stats(args.address)
    out["dram_budget_bytes"] = stats["dram_budget_bytes"]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
