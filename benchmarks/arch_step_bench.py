#!/usr/bin/env python3
"""The main job's two models side by side: the example GPT (gpt.py, preset
'main', 25.4M parameters) and the transformers Llama (llama.py,
configs/llama-main.json, 25.6M), one training step each (forward, backward,
torch.optim.AdamW(fused=True) step) on the main job's batch (4 x 64 bytes),
interleaved round by round so that both see the same load. Prints, per model,
the median wall time and process CPU time a step, and the Llama's over the
GPT's. No fuyou: this is what the architecture costs on this machine.

    .venv/bin/python benchmarks/arch_step_bench.py [--rounds 4] [--steps 3] [--threads 0]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python_client" / "examples"))
import gpt  # noqa: E402
import llama  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="rounds (the first warms up)")
    ap.add_argument("--steps", type=int, default=3, help="steps of each model a round")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models = {"gpt": gpt.GPT(gpt.PRESETS["main"]),
              "llama": llama.LlamaLM(llama.load_config(llama.config_path("main")))}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for k, m in models.items()}
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (4, 64), generator=gen)
    y = torch.randint(0, 256, (4, 64), generator=gen)
    wall = {k: [] for k in models}
    cpu = {k: [] for k in models}
    for r in range(args.rounds):
        for k, m in models.items():
            for _ in range(args.steps):
                t, c = time.perf_counter(), time.process_time()
                _, loss = m(x, y)
                loss.backward()
                opts[k].step()
                opts[k].zero_grad()
                if r > 0:
                    wall[k].append(time.perf_counter() - t)
                    cpu[k].append(time.process_time() - c)
    out = {k: {"parameters": models[k].num_parameters(),
               "wall_ms": 1e3 * statistics.median(wall[k]),
               "cpu_ms": 1e3 * statistics.median(cpu[k]),
               "tokens_per_s": 256 / statistics.median(wall[k])} for k in models}
    out["llama_over_gpt"] = {"wall": out["llama"]["wall_ms"] / out["gpt"]["wall_ms"],
                             "cpu": out["llama"]["cpu_ms"] / out["gpt"]["cpu_ms"]}
    out["threads"] = torch.get_num_threads()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
