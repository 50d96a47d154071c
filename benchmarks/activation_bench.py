#!/usr/bin/env python3
"""Activation offload (issue 23): peak saved-activation bytes on the device and
step time of a small GPT (python_client/examples/gpt.py) for four plans.

    .venv/bin/python benchmarks/activation_bench.py [--layers 4] [--embd 128] \\
        [--heads 4] [--batch 8] [--seq 128] [--steps 5] [--budget-frac 0.5] \\
        [--gpu] [--json out.json]

Plans, each through fuyou.offload_activations on its own copy of one model, fed
the same batches, steps interleaved (one step of each in turn):
  keep       every layer's saved tensors stay on the device (the accounting only);
  recompute  every layer under torch.utils.checkpoint (use_reentrant=False);
  host       every layer's saved tensors (>= 64 KiB) copied out to host memory;
  planned    the first step profiled, then the planner's choice within
             device_budget = --budget-frac x the keep plan's peak.
Peak device bytes are the hooks' accounting (ActivationStore.peak_device_bytes:
kept tensors, copies in flight and tensors brought back, plus the saved tensors
outside the layers, which every plan keeps). Step time: the median over the
steps after the first (the planned run's first step is its profile). The planned
run prints its plan table and its predicted vs measured step time. On the CPU
the "device" is the host: the copies are memcpys and the figures show the
accounting and the planner's choices, not a GPU's overlap.
"""
import argparse
import copy
import json
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_client"))
sys.path.insert(0, str(ROOT / "python_client" / "examples"))
import fuyou  # noqa: E402
from fuyou._activation_plan import format_bytes  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--budget-frac", type=float, default=0.5)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device("cuda" if args.gpu else "cpu")
    if args.gpu and not torch.cuda.is_available():
        sys.exit("--gpu: no CUDA device")
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.embd,
                    block_size=args.seq)
    base = GPT(cfg).to(device)

    def batch(step):
        g = torch.Generator().manual_seed(step)
        data = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g).to(device)
        return data[:, :-1], data[:, 1:]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    # the keep plan's peak sets the planned run's budget
    probe = copy.deepcopy(base)
    with fuyou.offload_activations(probe, plan="keep", verbose=False) as h:
        probe(*batch(0))[1].backward()
        keep_peak = h.store.peak_device_bytes
    budget = int(keep_peak * args.budget_frac)

    runs = {}
    for name, plan in (("keep", "keep"), ("recompute", "recompute"), ("host", "host"),
                       ("planned", None)):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        handle = fuyou.offload_activations(
            model, plan=plan, device_budget=budget if plan is None else None,
            verbose=plan is None)
        runs[name] = dict(model=model, opt=opt, handle=handle, times=[], fb_times=[], peaks=[],
                          losses=[])
    for step in range(args.steps):
        for name, r in runs.items():
            sync()
            t0 = time.perf_counter()
            _, loss = r["model"](*batch(step))
            loss.backward()
            sync()
            r["fb_times"].append(time.perf_counter() - t0)  # what the plan predicts
            r["opt"].step()
            r["opt"].zero_grad(set_to_none=True)
            sync()
            r["times"].append(time.perf_counter() - t0)
            r["peaks"].append(r["handle"].store.peak_device_bytes)
            r["losses"].append(float(loss))

    rows = []
    print(f"\nGPT {args.layers} x {args.embd}, batch {args.batch} x seq {args.seq}, "
          f"{device.type}; planned device_budget {format_bytes(budget)} "
          f"({args.budget_frac:g} x keep's peak)")
    print(f"{'plan':<10} {'choices':<34} {'peak device':>12} {'moved out/step':>15} "
          f"{'step ms':>9} {'vs keep':>8}")
    keep_s = statistics.median(runs["keep"]["times"][1:])
    for name, r in runs.items():
        h = r["handle"]
        step_s = statistics.median(r["times"][1:])
        peak = max(r["peaks"][1:])
        moved = h.store.traffic.bytes_moved_out / args.steps
        choices = ",".join(c[0] for c in h.choices)
        print(f"{name:<10} {choices:<34} {format_bytes(peak):>12} {format_bytes(moved):>15} "
              f"{step_s * 1e3:9.1f} {step_s / keep_s:7.2f}x")
        rows.append(dict(plan=name, choices=h.choices, peak_device_bytes=peak,
                         step_s=step_s, forward_backward_s=statistics.median(r["fb_times"][1:]), moved_out_per_step=moved, losses=r["losses"]))
    planned = runs["planned"]["handle"].plan
    if planned is not None:
        measured = statistics.median(runs["planned"]["fb_times"][1:])
        step_s = statistics.median(runs["planned"]["times"][1:])
        print(f"planned: predicted forward+backward {planned.predicted_step_s * 1e3:.1f} ms "
              f"(layers and outside), measured {measured * 1e3:.1f} ms (predicted / measured "
              f"{planned.predicted_step_s / measured:.2f}; the whole step with AdamW "
              f"{step_s * 1e3:.1f} ms); predicted device peak "
              f"{format_bytes(planned.predicted_device_peak)}, measured "
              f"{format_bytes(max(runs['planned']['peaks'][1:]))}")
    losses = {tuple(r["losses"]) for r in runs.values()}
    print("losses identical across plans:", len(losses) == 1)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(dict(budget=budget, rows=rows), indent=1))


if __name__ == "__main__":
    main()
