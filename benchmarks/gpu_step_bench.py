#!/usr/bin/env python3
"""One-GPU step benchmark of fuyou (issue 11).

    FUYOU_DAEMON=gpu-bundle/fuyoud PYTHONPATH=python_client \\
        python3 benchmarks/gpu_step_bench.py --out runs/gpu-bench
(deploy/gpu-check.sh runs it on the GPU machine with the bundle of deploy/gpu-bundle.sh.)

First a correctness check: a small GPT in fp32, 12 steps of fuyou.AdamW against
torch.optim.AdamW on the GPU, every weight within 1e-6 + 1e-5 |w|.

Then, for a GPT from python_client/examples/gpt.py (attention through
F.scaled_dot_product_attention where torch has it) at about 125M and 1B
parameters, bf16 weights, batch x 1024 tokens, in one run:

  gpu_fused         torch.optim.AdamW(fused=True) on the GPU (the ceiling)
  cpu_offload       plainly written CPU offload, ZeRO-Offload's order: gradients
                    to pinned fp32, torch.optim.AdamW(foreach=True) on the CPU over
                    fp32 masters, weights back
  fuyou_serial      fuyou.AdamW(overlap=False): everything at step()
  fuyou_overlap     fuyou.AdamW (overlap on), states in the daemon's DRAM
  fuyou_overlap_4x  the same with the states 4x the daemon's DRAM budget (swapping)

Per configuration: step time (median over the measured steps), tokens/s,
forward+backward time, step() time; for the model, forward+backward alone (no
optimizer, no hooks), the hooks' overhead, overlapped / max(fwd+bwd,
optimizer+I/O) with optimizer+I/O = fuyou_serial's step() time, D2H GB/s of the
pipeline's copy path into a session slot against a plain pinned copy of the same
bytes, and the daemon's stats (swap traffic). Writes <out>/gpu_step_bench.json
and <out>/timeline.png (matplotlib, if installed). Stops starting new
configurations when --budget-s is spent (they are reported as skipped).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO / "python_client", REPO / "python_client" / "examples"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fuyou  # noqa: E402
import gpt as gpt_example  # noqa: E402

T0 = time.monotonic()
SIZES = {
    "125m": dict(n_layer=12, n_head=12, n_embd=768),
    "1b": dict(n_layer=20, n_head=16, n_embd=2048),
}
VOCAB = 50304
DEVICE = "cuda"  # "cpu" with --dry-run-cpu: the same code paths on tiny models, no GPU


def log(msg):
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", flush=True)


def sdpa_forward(self, x):
    """CausalSelfAttention.forward with F.scaled_dot_product_attention."""
    b, t, c = x.shape
    q, k, v = self.qkv(x).split(c, dim=2)
    hs = c // self.n_head
    q, k, v = (z.view(b, t, self.n_head, hs).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.resid_drop(self.proj(y.transpose(1, 2).contiguous().view(b, t, c)))


if hasattr(F, "scaled_dot_product_attention"):
    gpt_example.CausalSelfAttention.forward = sdpa_forward


def make_model(size, dtype, seq, seed=0):
    torch.manual_seed(seed)
    cfg = gpt_example.GPTConfig(vocab_size=VOCAB, block_size=seq, dropout=0.0, **SIZES[size]) \
        if isinstance(size, str) else gpt_example.GPTConfig(block_size=seq, **size)
    return gpt_example.GPT(cfg).to(DEVICE, dtype)


def batch(step, bsz, seq, vocab):
    g = torch.Generator().manual_seed(7 + step)
    idx = torch.randint(0, vocab, (bsz, seq + 1), generator=g)
    return (idx[:, :-1].to(DEVICE, non_blocking=True),
            idx[:, 1:].to(DEVICE, non_blocking=True))


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def pinned(t):
    return t.pin_memory() if DEVICE == "cuda" else t


def new_daemon(tmp, name, dram_bytes):
    return fuyou.EmbeddedDaemon(
        data_dir=str(Path(tmp) / f"{name}-data"), socket_path=str(Path(tmp) / f"{name}.sock"),
        extra_args=["--dram-budget", f"{max(dram_bytes >> 20, 256)}MiB"])


# ------------------------------------------------------------------ correctness
def correctness(tmp):
    log("correctness: small GPT fp32, 12 steps, fuyou.AdamW vs torch.optim.AdamW on the GPU")
    cfg = dict(vocab_size=256, n_layer=4, n_head=4, n_embd=128)
    a = make_model(cfg, torch.float32, 128)
    # The reference steps copies of the weights with the same gradients, so the
    # check compares the optimizers, not two training trajectories.
    masters = [p.detach().clone().requires_grad_(True) for p in a.parameters()]
    with new_daemon(tmp, "check", 1 << 30) as d:
        opt = fuyou.AdamW(a.parameters(), lr=1e-3, weight_decay=0.1, job="check",
                          address=d.address, chunk_bytes=256 << 10, num_slots=3)
        ref = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.1, foreach=False)
        worst, ok = 0.0, True
        try:
            for step in range(12):
                _, loss = a(*batch(step, 4, 128, 256))
                loss.backward()
                for m, p in zip(masters, a.parameters()):
                    m.grad = p.grad.detach().clone()
                opt.step()
                ref.step()
                opt.zero_grad()
                for p, q in zip(a.parameters(), masters):
                    err = (p.detach() - q.detach()).abs()
                    worst = max(worst, err.max().item())
                    ok &= bool((err <= 1e-6 + 1e-5 * q.detach().abs()).all())
        finally:
            opt.close()
    log(f"correctness: max |w_fuyou - w_torch| = {worst:.3g} -> {'PASS' if ok else 'FAIL'}")
    return {"max_abs_diff": worst, "ok": ok}


# ------------------------------------------------------------------ runners
class Timer:
    """Per step: forward+backward and step() wall times (GPU synchronised)."""

    def __init__(self):
        self.steps = []

    def run(self, model, bsz, seq, step_fn, steps, warmup, after=None):
        for i in range(warmup + steps):
            x, y = batch(i, bsz, seq, model.cfg.vocab_size)
            sync()
            t0 = time.perf_counter()
            _, loss = model(x, y)
            loss.backward()
            sync()
            t1 = time.perf_counter()
            step_fn()
            sync()
            t2 = time.perf_counter()
            if i >= warmup:
                self.steps.append({"start": t0, "fwd_bwd": t1 - t0, "step": t2 - t1,
                                   "total": t2 - t0})
        return self

    def summary(self, bsz, seq):
        med = lambda k: statistics.median(s[k] for s in self.steps)  # noqa: E731
        total = med("total")
        return {"step_s": total, "fwd_bwd_s": med("fwd_bwd"), "opt_step_s": med("step"),
                "tokens_per_s": bsz * seq / total, "steps": self.steps}


def run_fwd_bwd_alone(model, bsz, seq, steps, warmup):
    def clear():
        for p in model.parameters():
            p.grad = None
    return Timer().run(model, bsz, seq, clear, steps, warmup)


def run_gpu_fused(model, bsz, seq, steps, warmup):
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    except (TypeError, RuntimeError):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)
    return Timer().run(model, bsz, seq, step, steps, warmup)


def run_cpu_offload(model, bsz, seq, steps, warmup):
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [pinned(p.detach().float().cpu()).requires_grad_(True) for p in params]
    grads = [pinned(torch.empty_like(m)) for m in masters]
    for m, g in zip(masters, grads):
        m.grad = g
    opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.1, foreach=True)
    staging = [pinned(torch.empty(p.shape, dtype=p.dtype)) for p in params]

    def step():
        for p, g in zip(params, grads):  # gradients to pinned fp32
            g.copy_(p.grad.float(), non_blocking=True)
        sync()
        opt.step()
        for p, m, s in zip(params, masters, staging):  # weights back
            s.copy_(m.detach())
            p.data.copy_(s, non_blocking=True)
            p.grad = None
    return Timer().run(model, bsz, seq, step, steps, warmup)


def run_fuyou(model, bsz, seq, steps, warmup, daemon, job, overlap, num_slots=8,
              chunk_bytes=32 << 20):
    t_open = time.perf_counter()
    opt = fuyou.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, job=job,
                      address=daemon.address, overlap=overlap, chunk_bytes=chunk_bytes,
                      num_slots=num_slots, timeout=600.0)
    open_s = time.perf_counter() - t_open
    before = fuyou.admin_stats(daemon.address)

    def step():
        opt.step()
        opt.zero_grad()
    try:
        t = Timer().run(model, bsz, seq, step, steps, warmup)
        after = fuyou.admin_stats(daemon.address)
        t.extra = {"open_s": open_s, "num_chunks": opt.num_chunks,
                   "pinned": bool(getattr(opt.pipeline.slots.device, "pinned", False)),
                   "pin_error": getattr(opt.pipeline.slots.device, "pin_error", None),
                   "loop_stats": vars(opt.loop_stats),
                   "daemon_stats_delta": {k: after[k] - before[k] for k in after
                                          if isinstance(after[k], (int, float))
                                          and isinstance(before.get(k), (int, float))},
                   "d2h": d2h_bandwidth(opt)}
    finally:
        opt.close()
    return t


def d2h_bandwidth(opt, reps=20):
    """GB/s of the pipeline's copy path (CudaDevice.copy_grads into a session
    slot) against torch's pinned buffer with a plain non_blocking copy, same bytes."""
    dev = opt.pipeline.slots.device
    if not getattr(dev, "streams", False):
        return None
    session = opt.pipeline.session
    region = torch.frombuffer(session.grad_region(0), dtype=torch.uint8)
    n = region.numel()
    src = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)
    pinned = torch.empty(n, dtype=torch.uint8).pin_memory()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        marker = dev.marker([src])
        dev.copy_grads(region, [(0, n, src)], marker)
    fuyou_s = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        pinned.copy_(src, non_blocking=True)
        sync()
    plain_s = (time.perf_counter() - t0) / reps
    return {"bytes": n, "pipeline_gbps": n / fuyou_s / 1e9, "pinned_memcpy_gbps": n / plain_s / 1e9,
            "ratio": plain_s / fuyou_s}


# ------------------------------------------------------------------ main
def bench_size(size, args, tmp, results, save):
    bsz, seq = args.batch, args.seq
    model = make_model(size, torch.bfloat16, seq)
    nparams = sum(p.numel() for p in model.parameters())
    state_bytes = 12 * nparams
    log(f"{size}: {nparams / 1e6:.0f}M parameters, bf16, batch {bsz} x {seq}; "
        f"fp32 states {state_bytes / 2**30:.1f} GiB")
    out = {"params": nparams, "batch": bsz, "seq": seq, "configs": {}}
    results["sizes"][size] = out
    steps, warmup = args.steps, args.warmup

    def budget_left():
        return args.budget_s - (time.monotonic() - T0)

    def record(name, fn):
        if budget_left() < args.reserve_s:
            log(f"{size} {name}: skipped (time budget spent)")
            out["configs"][name] = {"skipped": "time budget spent"}
            return None
        t0 = time.monotonic()
        try:
            t = fn()
        except Exception as e:  # noqa: BLE001 - a failed configuration is reported
            log(f"{size} {name}: FAILED {type(e).__name__}: {e}")
            out["configs"][name] = {"error": f"{type(e).__name__}: {e}"}
            return None
        s = t.summary(bsz, seq)
        s.update(getattr(t, "extra", {}))
        s["wall_s"] = time.monotonic() - t0
        out["configs"][name] = s
        save()
        log(f"{size} {name:17s} step {s['step_s'] * 1e3:8.1f} ms  fwd+bwd "
            f"{s['fwd_bwd_s'] * 1e3:8.1f} ms  step() {s['opt_step_s'] * 1e3:8.1f} ms  "
            f"{s['tokens_per_s']:9.0f} tok/s")
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        return s

    init = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def fresh():
        model.load_state_dict(init)
        for p in model.parameters():
            p.grad = None
        return model

    record("fwd_bwd_alone", lambda: run_fwd_bwd_alone(fresh(), bsz, seq, steps, warmup))
    record("gpu_fused", lambda: run_gpu_fused(fresh(), bsz, seq, steps, warmup))
    record("cpu_offload", lambda: run_cpu_offload(fresh(), bsz, seq, steps, warmup))
    big = state_bytes + (4 << 30)  # one daemon per job: each job's states fit its DRAM
    with new_daemon(tmp, f"{size}-serial", big) as d:
        record("fuyou_serial", lambda: run_fuyou(fresh(), bsz, seq, steps, warmup, d,
                                                 f"{size}-serial", overlap=False))
    with new_daemon(tmp, f"{size}-dram", big) as d:
        record("fuyou_overlap", lambda: run_fuyou(fresh(), bsz, seq, steps, warmup, d,
                                                  f"{size}-overlap", overlap=True))
    with new_daemon(tmp, f"{size}-swap", state_bytes // 4) as d:
        record("fuyou_overlap_4x", lambda: run_fuyou(fresh(), bsz, seq, args.swap_steps, 1, d,
                                                     f"{size}-swap", overlap=True))
    c = out["configs"]
    alone = c.get("fwd_bwd_alone", {}).get("step_s")
    serial = c.get("fuyou_serial", {}).get("opt_step_s")
    derived = {}
    for name in ("fuyou_overlap", "fuyou_overlap_4x"):
        s = c.get(name, {})
        if "step_s" in s and alone and serial:
            derived[name] = {
                "hook_overhead": s["fwd_bwd_s"] / alone - 1.0,
                "overlapped_over_max": s["step_s"] / max(alone, serial),
            }
            if "cpu_offload" in c and "step_s" in c["cpu_offload"]:
                derived[name]["speedup_vs_cpu_offload"] = c["cpu_offload"]["step_s"] / s["step_s"]
    out["derived"] = derived
    for name, dv in derived.items():
        log(f"{size} {name}: hooks +{dv['hook_overhead'] * 100:.1f}% fwd+bwd, "
            f"overlapped/max(fwd+bwd, opt+I/O) = {dv['overlapped_over_max']:.2f}, "
            f"x{dv.get('speedup_vs_cpu_offload', float('nan')):.2f} vs cpu_offload")
    for name in ("fuyou_overlap", "fuyou_overlap_4x"):
        s = c.get(name, {})
        if s.get("d2h"):
            d = s["d2h"]
            log(f"{size} {name}: D2H {d['pipeline_gbps']:.1f} GB/s via the slot vs "
                f"{d['pinned_memcpy_gbps']:.1f} GB/s pinned memcpy ({d['ratio'] * 100:.0f}%)")
        if s.get("daemon_stats_delta"):
            swap = {k: v for k, v in s["daemon_stats_delta"].items()
                    if k in ("bytes_read", "bytes_written", "cache_hits", "cache_misses",
                             "chunk_updates", "dram_budget_bytes", "chunks_redone_changed")}
            log(f"{size} {name}: daemon stats over the run: {swap}")
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def timeline(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("timeline: matplotlib not installed, no PNG")
        return
    rows = [(size, name, cfg) for size, r in results["sizes"].items()
            for name, cfg in r["configs"].items() if "steps" in cfg]
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.5))
    for i, (size, name, cfg) in enumerate(rows):
        t0 = cfg["steps"][0]["start"]
        for s in cfg["steps"]:
            x = s["start"] - t0
            ax.barh(i, s["fwd_bwd"], left=x, color="tab:blue")
            ax.barh(i, s["step"], left=x + s["fwd_bwd"], color="tab:orange")
    ax.set_yticks(range(len(rows)), [f"{s} {n}" for s, n, _ in rows])
    ax.set_xlabel("seconds (blue: forward+backward, orange: step())")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"timeline: {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/gpu-bench")
    ap.add_argument("--sizes", default="125m,1b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--swap-steps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=440.0,
                    help="start no new configuration after this many seconds")
    ap.add_argument("--reserve-s", type=float, default=45.0)
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="run every code path on the CPU with tiny models (no GPU needed)")
    args = ap.parse_args()
    global DEVICE
    if args.dry_run_cpu:
        DEVICE = "cpu"
        SIZES.clear()
        SIZES.update({"tiny": dict(n_layer=2, n_head=2, n_embd=64)})
        args.sizes, args.batch, args.seq, args.steps, args.warmup = "tiny", 2, 64, 2, 1
        args.swap_steps = 2
        globals()["VOCAB"] = 512
    elif not torch.cuda.is_available():
        print("skipped: no GPU (gpu_step_bench needs CUDA)")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)", "torch": torch.__version__,
               "cpus": os.cpu_count(), "sdpa": hasattr(F, "scaled_dot_product_attention"),
               "sizes": {}}
    def save():  # after every configuration: a run cut short keeps what it measured
        results["wall_s"] = time.monotonic() - T0
        (out / "gpu_step_bench.json").write_text(json.dumps(results, indent=1, default=str))

    with tempfile.TemporaryDirectory(prefix="fuyou-gpu-bench-") as tmp:
        results["correctness"] = correctness(tmp)
        save()
        for size in args.sizes.split(","):
            try:
                bench_size(size, args, tmp, results, save)
            except Exception as e:  # noqa: BLE001
                log(f"{size}: FAILED {type(e).__name__}: {e}")
                results["sizes"].setdefault(size, {})["error"] = str(e)
    save()
    log(f"wrote {out / 'gpu_step_bench.json'}")
    timeline(results, out / "timeline.png")
    return 0 if results["correctness"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
