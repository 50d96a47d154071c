#!/usr/bin/env python3
"""Parameter streaming (issue 12): a GPT whose working weights live in fuyoud and
stream into the model module by module, against the same GPT fully resident.

    .venv/bin/python benchmarks/param_stream_bench.py --fuyoud BUILD/daemon/fuyoud \\
        [--layers 8] [--embd 512] [--heads 8] [--batch 4] [--seq 128] [--steps 4] \\
        [--dram-budget 64MiB] [--device-budget BYTES|SIZE] [--prefetch 2] \\
        [--chunk-mib 4] [--gpu [--gpu-cap 1GiB]] [--no-resident] [--clip MAX_NORM]
        [--json out.json]

Variants, each with its own job on one fuyoud, steps interleaved:
  resident   the GPT built normally and kept whole in the model (fuyou.AdamW: the
             optimizer states in fuyoud, the weights in the model);
  streamed   the same GPT built in fuyou.init_empty, materialized module by module
             into fuyou.AdamW(offload_params=True) (every weight sent to the daemon
             and freed), trained through fuyou.stream_parameters(device_budget=).
Both start from the same weights (one init function, one seed) and see the same
batches, so their losses must agree; the table gives step time and tokens/s, the
SSD bytes read per step (the daemon's GetStats: all reads, and weights_bytes_read,
the working weights streamed) against the model's weight bytes, and the stream's
peak live bytes against device_budget (+ the largest module, the issue's bound).

--clip MAX_NORM: every variant calls torch.nn.utils.clip_grad_norm_(model.parameters(),
MAX_NORM) between backward and step() (the HF Trainer loop). The streamed variant's
gradients are freed once sent and kept in the daemon's per-step journal; a clip that
scales them replays every chunk's update there. The table's journal columns give its
cost: bytes journaled a step, chunk updates replayed a step and the seconds step()
spent on redos (loop_stats).

--gpu: the model runs on CUDA, with device memory capped at --gpu-cap by
torch.cuda.set_per_process_memory_fraction; the resident variant runs only when
its weights, gradients and activations fit under the cap (else "does not fit").
Host figures (DRAM budget, SSD) are the daemon's. Run with the project's venv (.venv/bin/python).
"""
import argparse
import json
import os
import pathlib
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_client"))
sys.path.insert(0, str(ROOT / "python_client" / "examples"))
import fuyou  # noqa: E402
from fuyou._sizes import parse_size  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fuyoud", default=os.environ.get("FUYOU_DAEMON"),
                    help="fuyoud binary (default $FUYOU_DAEMON)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="timed steps of each variant")
    ap.add_argument("--dram-budget", default="64MiB", help="fuyoud's --dram-budget")
    ap.add_argument("--device-budget", default=None,
                    help="stream_parameters' device_budget (default: the weights / 8)")
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--chunk-mib", type=float, default=4.0, help="MiB of weights a chunk")
    ap.add_argument("--gpu", action="store_true", help="run the model on CUDA")
    ap.add_argument("--gpu-cap", default="1GiB",
                    help="device memory cap (set_per_process_memory_fraction) with --gpu")
    ap.add_argument("--no-resident", action="store_true", help="skip the resident variant")
    ap.add_argument("--clip", type=float, default=None,
                    help="external clip_grad_norm_(model.parameters(), CLIP) before step()")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json")
    return ap.parse_args()


class StreamableGPT(GPT):
    """examples/gpt.py's GPT with its tied LM head as a module (``head``, whose
    weight is the token embedding's): stream_parameters fetches a module's
    weights around the module's own forward, and the example's forward reads
    ``tok_emb.weight`` from the root's."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight

    def forward(self, idx, targets=None):
        b, t = idx.shape
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)),
                                               targets.reshape(-1))
        return logits, loss


def init_weights(module: nn.Module) -> None:
    """GPT's own init (examples/gpt.py), module by module: N(0, 0.02) for Linear
    and Embedding weights, zero biases, LayerNorm's reset. The GPT-2 scaled init of
    the residual projections is left out: it is applied by name, over the model."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
        module.reset_parameters()


def build_resident(cfg, device):
    model = StreamableGPT(cfg)
    torch.manual_seed(1)
    seen = set()
    with torch.no_grad():
        for m in model.modules():  # what materialize(init=) does, in the same order
            own = [p for p in m.parameters(recurse=False) if id(p) not in seen]
            if own:
                init_weights(m)
                seen.update(id(p) for p in own)
    return model.to(device)


def process_cpu_s(pid) -> float:
    """User + system CPU seconds of process `pid` so far (/proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def daemon_reads(address):
    s = fuyou.admin_stats(address)
    return s.get("bytes_read", 0), s.get("weights_bytes_read", 0), s.get("weights_fetches", 0)


def main():
    args = parse_args()
    if not args.fuyoud or not os.access(args.fuyoud, os.X_OK):
        sys.exit("param_stream_bench: give --fuyoud PATH (or set FUYOU_DAEMON)")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.gpu else "cpu")
    cap = None
    if args.gpu:
        if not torch.cuda.is_available():
            sys.exit("param_stream_bench: --gpu without CUDA")
        cap = parse_size(args.gpu_cap, "--gpu-cap")
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.embd)
    tokens = args.batch * args.seq
    data = [torch.randint(0, 256, (args.batch, args.seq + 1), generator=torch.Generator()
                          .manual_seed(i)) for i in range(4)]
    chunk_bytes = int(args.chunk_mib * (1 << 20))

    with tempfile.TemporaryDirectory(prefix="param-stream-bench-") as tmp:
        daemon = fuyou.EmbeddedDaemon(data_dir=os.path.join(tmp, "data"),
                                      extra_args=["--dram-budget", args.dram_budget,
                                                  "--log-level", "warn"],
                                      binary=args.fuyoud)
        try:
            result = run(args, cfg, device, cap, daemon, data, tokens, chunk_bytes)
        finally:
            daemon.stop()
    report(args, result, tokens)


def run(args, cfg, device, cap, daemon, data, tokens, chunk_bytes):
    # The streamed model: never whole anywhere but in the daemon.
    with fuyou.init_empty(job="param-stream-streamed"):
        streamed = StreamableGPT(cfg)
    weight_bytes = sum(p.numel() * p.element_size() for p in streamed.parameters())
    largest_module = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
                         for m in streamed.modules())
    n_params = sum(p.numel() for p in streamed.parameters())
    budget = (parse_size(args.device_budget, "--device-budget") if args.device_budget
              else weight_bytes // 8)
    s_opt = fuyou.AdamW(streamed.parameters(), lr=1e-4, address=daemon.address,
                        chunk_bytes=chunk_bytes, offload_params=True, timeout=600)
    t0 = time.perf_counter()
    torch.manual_seed(1)
    fuyou.materialize(streamed, s_opt, init=init_weights, device=device)
    materialize_s = time.perf_counter() - t0
    rss_after_materialize = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    handle = fuyou.stream_parameters(streamed, s_opt, device_budget=budget,
                                     prefetch=args.prefetch)
    variants = {"streamed": (streamed, s_opt)}

    resident_note = None
    if not args.no_resident:
        try:
            model = build_resident(cfg, device)
            r_opt = fuyou.AdamW(model.parameters(), lr=1e-4, job="param-stream-resident",
                                address=daemon.address, chunk_bytes=chunk_bytes, timeout=600)
            variants = {"resident": (model, r_opt), **variants}
        except RuntimeError as e:  # CUDA out of memory under the cap
            if "out of memory" not in str(e):
                raise
            resident_note = "does not fit"
            torch.cuda.empty_cache()
    print(f"param_stream_bench: GPT {args.layers}x{args.embd} ({n_params / 1e6:.1f}M params, "
          f"{weight_bytes / 2**20:.0f} MiB of weights, {12 * n_params / 2**20:.0f} MiB of fp32 "
          f"states), batch {args.batch}x{args.seq} = {tokens} tokens, {device}"
          f"{f' capped at {cap / 2**20:.0f} MiB' if cap else ''}; fuyoud budget "
          f"{args.dram_budget}; device_budget {budget / 2**20:.1f} MiB "
          f"(weights / {weight_bytes / budget:.1f}), largest module "
          f"{largest_module / 2**20:.1f} MiB; materialize {materialize_s:.2f} s", flush=True)

    times = {k: [] for k in variants}
    losses = {k: [] for k in variants}
    reads = {k: [] for k in variants}
    journal = {k: [] for k in variants}  # per step: journaled bytes, replays, redo seconds
    cpu = {k: [] for k in variants}  # per step: the client's and fuyoud's CPU seconds
    peak_mem = {k: 0 for k in variants}
    for i in range(args.steps + 1):  # step 0 warms up (and records the streaming order)
        batch = data[i % len(data)].to(device)
        x, y = batch[:, :-1], batch[:, 1:]
        for name, (model, opt) in variants.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            before = daemon_reads(daemon.address)
            stats_before = opt.loop_stats
            cpu_before = (time.process_time(), process_cpu_s(daemon.pid))
            t0 = time.perf_counter()
            _, loss = model(x, y)
            loss.backward()
            if args.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
                peak_mem[name] = max(peak_mem[name], torch.cuda.max_memory_allocated())
            dt = time.perf_counter() - t0
            cpu_after = (time.process_time(), process_cpu_s(daemon.pid))
            after = daemon_reads(daemon.address)
            losses[name].append(float(loss))
            if i > 0:
                times[name].append(dt)
                reads[name].append([a - b for a, b in zip(after, before)])
                cpu[name].append([a - b for a, b in zip(cpu_after, cpu_before)])
                st = opt.loop_stats
                journal[name].append((st.journaled_bytes - stats_before.journaled_bytes,
                                      st.replayed - stats_before.replayed,
                                      st.redo_seconds - stats_before.redo_seconds))
        print(f"  step {i}{' (warm-up)' if i == 0 else ''}: " + ", ".join(
            f"{k} loss {losses[k][-1]:.4f}" + (f" {times[k][-1]:.3f} s" if i > 0 else "")
            for k in variants), flush=True)
    peak_live = handle.peak_live_bytes
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    fetches, hits = handle.fetches, handle.cache_hits
    for _model, opt in variants.values():
        opt.close()
    return dict(n_params=n_params, weight_bytes=weight_bytes, largest_module=largest_module,
                budget=budget, cap=cap, device=str(device), materialize_s=materialize_s,
                times=times, losses=losses, reads=reads, journal=journal, cpu=cpu, peak_live=peak_live,
                fetches=fetches, cache_hits=hits, peak_device_memory=peak_mem,
                resident_note=resident_note, peak_rss_after_materialize=rss_after_materialize,
                peak_rss=peak_rss)


def report(args, r, tokens):
    med = {k: statistics.median(v) for k, v in r["times"].items()}
    w = r["weight_bytes"]
    rows = []
    for k in r["times"]:
        per_step = [statistics.median(x) for x in zip(*r["reads"][k])]  # all, weights, fetches
        rows.append((k, med[k], tokens / med[k], per_step[0], per_step[1], per_step[2]))
    print(f"\n{'variant':<10} {'step s':>8} {'tokens/s':>9} {'SSD read/step MiB':>18} "
          f"{'weights read/step MiB':>22} {'/ weights':>10} {'fetches':>8}")
    for k, t, tps, all_read, w_read, fetches in rows:
        print(f"{k:<10} {t:>8.3f} {tps:>9.0f} {all_read / 2**20:>18.1f} {w_read / 2**20:>22.1f} "
              f"{w_read / w:>10.2f} {fetches:>8.0f}")
    if r["resident_note"]:
        print(f"resident   {r['resident_note']}")
    print(f"\n{'variant':<10} {'client CPU s/step':>18} {'fuyoud CPU s/step':>18}   "
          f"(what the two sides take of the machine's cores a step)")
    for k, steps in r["cpu"].items():
        client, daemon_s = (statistics.median(x) for x in zip(*steps))
        print(f"{k:<10} {client:>18.3f} {daemon_s:>18.3f}")
    print(f"\n{'variant':<10} {'journaled MiB/step':>19} {'replays/step':>13} "
          f"{'redo s/step':>12}   (clip_grad_norm_: {args.clip})")
    for k, steps in r["journal"].items():
        b, n, sec = (statistics.median(x) for x in zip(*steps))
        print(f"{k:<10} {b / 2**20:>19.1f} {n:>13.0f} {sec:>12.3f}")
    bound = r["budget"] + r["largest_module"]
    print(f"\nstreamed peak live bytes {r['peak_live'] / 2**20:.1f} MiB; device_budget "
          f"{r['budget'] / 2**20:.1f} MiB (+ largest module = {bound / 2**20:.1f} MiB); "
          f"weights {w / 2**20:.1f} MiB = {w / r['budget']:.1f}x the budget; "
          f"client fetches {r['fetches']}, cache hits {r['cache_hits']}")
    print(f"client peak RSS: {r['peak_rss_after_materialize'] / 2**20:.0f} MiB after materialize, "
          f"{r['peak_rss'] / 2**20:.0f} MiB at the end (resident variant included when it ran)")
    if "resident" in med:
        print(f"streamed / resident step time = {med['streamed'] / med['resident']:.2f}; max loss "
              f"difference {max(abs(a - b) for a, b in zip(r['losses']['streamed'], r['losses']['resident'])):.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "param_stream_bench", "config": vars(args),
                       "torch_threads": torch.get_num_threads(), "median_step_s": med,
                       "tokens_per_s": {k: tokens / v for k, v in med.items()}, **r}, f, indent=2)
        print("wrote", args.json)


if __name__ == "__main__":
    main()
