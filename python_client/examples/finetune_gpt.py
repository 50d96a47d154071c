#!/usr/bin/env python3
"""Fine-tunes a small GPT with fuyou.AdamW (optimizer states offloaded to fuyoud).

What it does, with the defaults (about 2-4 minutes on 2 CPU cores):

  1. Base model: loads --checkpoint, or trains a fresh one for --base-steps on the
     base corpus (KJV Genesis + Exodus) with torch.optim.AdamW and saves it.
  2. Fine-tunes it for --steps on a different corpus (the SQLite C API reference)
     with fuyou.AdamW (or torch.optim.AdamW with --optimizer torch, to compare).
     A progress bar shows the loss, tokens/s and, with fuyou, the daemon's SSD
     read/write rates.
  3. Reports held-out loss before and after, tokens/s, the bytes the daemon read
     and wrote, and the daemon's final stats; saves a checkpoint (model +
     optimizer state_dict), a loss-curve PNG and metrics.json under --out-dir.

With --optimizer fuyou and the default --daemon auto, fuyou.AdamW decides whether
to use a running fuyoud or start a private one (the "embedded" daemon, whose
binary comes from $FUYOU_DAEMON, e.g. build/daemon/fuyoud). deploy/main-job.sh
runs this script with everything set up.

    /usr/bin/python3 python_client/examples/finetune_gpt.py --optimizer torch
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import pathlib
import sys
import time
from typing import Dict, List, Optional

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpt import GPT, PRESETS, ByteTokenizer  # noqa: E402

DATA_DIR = HERE / "data"
BASE_CORPUS = DATA_DIR / "kjv_genesis_exodus.txt"
FINETUNE_CORPUS = DATA_DIR / "sqlite_api_docs.txt"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BASE_GRAD_CLIP = 1.0  # the base run's high learning rate needs it


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--job", default="gpt-finetune-demo",
                   help="fuyou job name (1-64 of [A-Za-z0-9._-]); a job that exists is resumed")
    p.add_argument("--steps", type=int, default=150, help="fine-tuning steps")
    p.add_argument("--base-steps", type=int, default=100,
                   help="steps of base training when no --checkpoint is given")
    p.add_argument("--checkpoint", type=pathlib.Path, default=None,
                   help="base model checkpoint (a file this script saved); trains one if absent")
    p.add_argument("--out-dir", type=pathlib.Path, default=None, help="default: runs/<job>/")
    p.add_argument("--optimizer", choices=["fuyou", "torch"], default="fuyou",
                   help="optimizer of the fine-tuning phase")
    p.add_argument("--base-optimizer", choices=["torch", "fuyou"], default="torch",
                   help="optimizer of the base training (fuyou uses job '<job>-base')")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="dtype of the model's working weights (fuyou keeps fp32 masters)")
    p.add_argument("--model", choices=sorted(PRESETS), default="small", help="size preset")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3, help="fine-tuning learning rate")
    p.add_argument("--base-lr", type=float, default=3e-3, help="base training learning rate")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps (cosine after)")
    p.add_argument("--grad-clip", type=float, default=0.0,
                   help="fine-tuning: clip by global norm; 0 = off. With fuyou this is "
                        "AdamW(max_grad_norm=...) (see --clip-with): chunks are updated "
                        "speculatively during backward and redone at step() when the clip "
                        "coefficient is < 1 (base training always clips at 1.0)")
    p.add_argument("--clip-with", choices=["optimizer", "external"], default="optimizer",
                   help="fuyou: clip with AdamW(max_grad_norm=) or with "
                        "torch.nn.utils.clip_grad_norm_ before step() as torch loops do "
                        "(fuyou then redoes the chunks whose gradients it changed)")
    p.add_argument("--no-overlap", action="store_true",
                   help="fuyou.AdamW(overlap=False): send every chunk at step(), after "
                        "backward (the serial path: nothing speculative, nothing redone)")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20,
                   help="fuyou chunk size in bytes; small so a tiny model has several chunks")
    p.add_argument("--daemon", choices=["auto", "embedded", "external"], default="auto",
                   help="fuyou.AdamW(embedded=None|True|False): auto uses a running fuyoud "
                        "and starts a private one when none answers; embedded always starts "
                        "one (its states go to $FUYOU_DATA_DIR, default ./fuyou-data)")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation")
    p.add_argument("--eval-every", type=int, default=50, help="evaluate every N fine-tuning steps")
    p.add_argument("--sample-bytes", type=int, default=200,
                   help="bytes to sample from the fine-tuned model at the end; 0 = none")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 = torch's default")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar (log lines instead)")
    args = p.parse_args(argv)
    if args.seq_len > PRESETS[args.model].block_size:
        p.error(f"--seq-len {args.seq_len} exceeds the model's block size "
                f"{PRESETS[args.model].block_size}")
    if args.out_dir is None:
        args.out_dir = pathlib.Path("runs") / args.job
    return args


# --- data ---------------------------------------------------------------------

class TextDataset:
    """A corpus as byte tokens, split into a training part and a held-out tail."""

    def __init__(self, path: pathlib.Path, tokenizer: ByteTokenizer, val_fraction: float = 0.1):
        self.name = path.name
        tokens = tokenizer.encode(path.read_text(encoding="utf-8"))
        n_val = max(int(len(tokens) * val_fraction), 1)
        self.train = tokens[:-n_val]
        self.val = tokens[-n_val:]

    @staticmethod
    def _windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int):
        x = torch.stack([data[s:s + seq_len] for s in starts.tolist()])
        y = torch.stack([data[s + 1:s + 1 + seq_len] for s in starts.tolist()])
        return x, y

    def train_batch(self, batch_size: int, seq_len: int, gen: torch.Generator):
        """Random windows of the training part."""
        starts = torch.randint(0, len(self.train) - seq_len - 1, (batch_size,), generator=gen)
        return self._windows(self.train, starts, seq_len)

    def val_batches(self, n_batches: int, batch_size: int, seq_len: int):
        """The same evenly spaced windows of the held-out part on every call."""
        limit = len(self.val) - seq_len - 1
        count = n_batches * batch_size
        starts = torch.linspace(0, limit, count).long()
        for i in range(n_batches):
            yield self._windows(self.val, starts[i * batch_size:(i + 1) * batch_size], seq_len)


@torch.no_grad()
def evaluate(model: GPT, data: TextDataset, args) -> float:
    model.eval()
    losses = [model(x, y)[1].item()
              for x, y in data.val_batches(args.eval_batches, args.batch_size, args.seq_len)]
    model.train()
    return sum(losses) / len(losses)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


# --- fuyou --------------------------------------------------------------------

def import_fuyou():
    """Imports the fuyou package lazily: --optimizer torch works without it."""
    try:
        return importlib.import_module("fuyou")
    except ImportError:
        sys.path.insert(0, str(HERE.parent))  # python_client/ of this checkout
        try:
            return importlib.import_module("fuyou")
        except ImportError as e:
            sys.exit(f"error: cannot import the fuyou package ({e}). Build it first "
                     "(deploy/build.sh) and run from the repository root, or use "
                     "--optimizer torch.")


def make_optimizer(kind: str, params, lr: float, args, job: str, grad_clip: float):
    """torch.optim.AdamW or fuyou.AdamW with the same hyper-parameters.

    Clipping: with torch, train() calls clip_grad_norm_ before step(). fuyou.AdamW
    sends gradients to the daemon during backward (speculative updates); by default
    it clips itself (max_grad_norm, exactly like clip_grad_norm_) and redoes the
    chunks at step() only in steps where the norm is above the limit. With
    --clip-with external the loop calls clip_grad_norm_ as with torch; fuyou finds
    the changed gradients at step() and redoes those chunks.
    """
    hyper = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=args.weight_decay)
    if kind == "torch":
        return torch.optim.AdamW(params, **hyper)
    fuyou = import_fuyou()
    embedded = {"auto": None, "embedded": True, "external": False}[args.daemon]
    extra = {"max_grad_norm": grad_clip} if grad_clip > 0 and args.clip_with == "optimizer" else {}
    return fuyou.AdamW(params, job=job, chunk_bytes=args.chunk_bytes, embedded=embedded,
                       overlap=not args.no_overlap, **extra, **hyper)


class StatsPoller:
    """Reads fuyou.admin_stats at most once a second and turns the counters into
    totals since the poller was made (a shared daemon has counted other jobs too)."""

    def __init__(self, optimizer, min_interval_s: float = 1.0):
        self._fuyou = sys.modules.get("fuyou")
        self._address = getattr(optimizer, "address", None)
        self._enabled = self._fuyou is not None and self._address is not None
        self._min_interval = min_interval_s
        self._last_poll = 0.0
        self.error: Optional[str] = None
        self.latest: Optional[dict] = None
        self._baseline = self.poll(force=True)

    def poll(self, force: bool = False) -> Optional[dict]:
        now = time.monotonic()
        if not self._enabled or (not force and now - self._last_poll < self._min_interval):
            return self.latest
        self._last_poll = now
        try:
            self.latest = self._fuyou.admin_stats(address=self._address)
        except Exception as e:  # stats are informative: never stop training for them
            self.error = f"{type(e).__name__}: {e}"
        return self.latest

    @staticmethod
    def _sum(stats: Optional[dict], key: str) -> float:
        """The daemon's total of `key` (bytes_read, read_gbps, ...): over every
        storage path for an administrator, over the caller's own jobs for any other
        user (whose answer has no storage paths)."""
        if not stats:
            return 0.0
        if key in stats:
            return float(stats[key])
        return float(sum(p.get(key, 0) for p in stats.get("storage", [])))

    def rates_gbps(self):
        """(read GB/s, write GB/s) of the storage traffic, or None without stats."""
        if not self.latest:
            return None
        return self._sum(self.latest, "read_gbps"), self._sum(self.latest, "write_gbps")

    def bytes_since_start(self):
        """(bytes read, bytes written) on the daemon's storage since the poller
        started: every job's for an administrator, the caller's own otherwise."""
        if not self.latest:
            return None
        return (self._sum(self.latest, "bytes_read") - self._sum(self._baseline, "bytes_read"),
                self._sum(self.latest, "bytes_written") - self._sum(self._baseline, "bytes_written"))


# --- training -----------------------------------------------------------------

def train(model: GPT, opt, data: TextDataset, steps: int, peak_lr: float, args,
          desc: str, seed: int, grad_clip: float, poller: Optional[StatsPoller] = None,
          eval_data: Optional[TextDataset] = None) -> Dict[str, list]:
    """Runs `steps` optimizer steps; returns the loss history.

    The learning rate is set before backward: fuyou.AdamW sends each chunk's
    update, with the group's lr at that moment, while backward runs."""
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(seed)
    tokens_per_step = args.batch_size * args.seq_len
    history = {"step": [], "loss": [], "eval_step": [], "eval_loss": []}
    bar = tqdm(range(steps), desc=desc, unit="step", dynamic_ncols=True,
               disable=args.no_progress, file=sys.stdout)
    t0 = time.perf_counter()
    for i in bar:
        lr = lr_at(i, steps, peak_lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = data.train_batch(args.batch_size, args.seq_len, gen)
        _, loss = model(x, y)
        loss.backward()
        if grad_clip > 0 and (isinstance(opt, torch.optim.AdamW) or args.clip_with == "external"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

        history["step"].append(i + 1)
        history["loss"].append(loss.item())
        elapsed = time.perf_counter() - t0
        postfix = {"loss": f"{loss.item():.3f}",
                   "tok/s": f"{tokens_per_step * (i + 1) / elapsed:,.0f}"}
        if poller is not None:
            poller.poll()
            rates = poller.rates_gbps()
            postfix["ssd R/W GB/s"] = "n/a" if rates is None else f"{rates[0]:.2f}/{rates[1]:.2f}"
        bar.set_postfix(postfix, refresh=False)
        if args.no_progress and ((i + 1) % 10 == 0 or i + 1 == steps):
            print(f"{desc} step {i + 1}/{steps} " + " ".join(f"{k}={v}" for k, v in postfix.items()),
                  flush=True)
        if eval_data is not None and args.eval_every > 0 and (i + 1) % args.eval_every == 0 \
                and i + 1 < steps:
            history["eval_step"].append(i + 1)
            history["eval_loss"].append(evaluate(model, eval_data, args))
    bar.close()
    history["seconds"] = time.perf_counter() - t0
    history["tokens_per_second"] = tokens_per_step * steps / max(history["seconds"], 1e-9)
    return history


def train_base_model(model: GPT, args, tokenizer: ByteTokenizer) -> List[float]:
    """Trains the base model (fp32) on the base corpus and saves it to
    <out-dir>/base.pt; returns its training losses."""
    data = TextDataset(BASE_CORPUS, tokenizer)
    print(f"base training: {args.base_steps} steps on {data.name} "
          f"({len(data.train):,} training bytes) with {args.base_optimizer} AdamW")
    opt = make_optimizer(args.base_optimizer, model.parameters(), args.base_lr, args,
                         job=f"{args.job}-base", grad_clip=BASE_GRAD_CLIP)
    try:
        hist = train(model, opt, data, args.base_steps, args.base_lr, args, desc="base",
                     seed=args.seed, grad_clip=BASE_GRAD_CLIP)
    finally:
        if args.base_optimizer == "fuyou":
            opt.close()
    path = args.out_dir / "base.pt"
    torch.save({"model": model.state_dict(), "model_preset": args.model,
                "base_steps": args.base_steps,
                "base_loss": hist["loss"]}, path)
    print(f"base model: held-out loss {evaluate(model, data, args):.3f} on {data.name}; "
          f"saved {path}")
    return hist["loss"]


def plot_losses(path: pathlib.Path, base_losses: List[float], ft: Dict[str, list],
                ft_before: float, ft_after: float, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = 2 if base_losses else 1
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4), squeeze=False)
    if base_losses:
        ax = axes[0][0]
        ax.plot(range(1, len(base_losses) + 1), base_losses, lw=1)
        ax.set(title="base training (KJV)", xlabel="step", ylabel="train loss (nats/byte)")
        ax.grid(alpha=0.3)
    ax = axes[0][-1]
    ax.plot(ft["step"], ft["loss"], lw=1, label="train")
    ev_steps = [0] + ft["eval_step"] + [ft["step"][-1] if ft["step"] else 0]
    ev_loss = [ft_before] + ft["eval_loss"] + [ft_after]
    ax.plot(ev_steps, ev_loss, "o-", label="held-out")
    ax.set(title=title, xlabel="step", ylabel="loss (nats/byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n):,} B"
        n /= 1024
    return str(n)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    dtype = DTYPES[args.dtype]
    tokenizer = ByteTokenizer()

    model = GPT(PRESETS[args.model])
    print(f"model: {args.model}, {model.num_parameters():,} parameters, {args.dtype}; "
          f"batch {args.batch_size} x {args.seq_len} tokens; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s)")

    base_losses: List[float] = []
    if args.checkpoint is not None:
        ckpt = torch.load(args.checkpoint, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        print(f"base model: loaded {args.checkpoint}")
    else:
        base_losses = train_base_model(model, args, tokenizer)
    model.to(dtype)
    if dtype != torch.float32 and args.optimizer == "torch":
        print("note: torch.optim.AdamW keeps its states in the weights' dtype "
              f"({args.dtype}); fuyou keeps fp32 master weights and moments.")

    base_data = TextDataset(BASE_CORPUS, tokenizer)
    ft_data = TextDataset(FINETUNE_CORPUS, tokenizer)

    # Made before the "before" evaluation: a resumed fuyou job replaces the weights.
    opt = make_optimizer(args.optimizer, model.parameters(), args.lr, args, job=args.job,
                         grad_clip=args.grad_clip)
    try:
        poller = None
        if args.optimizer == "fuyou":
            print(f"fuyou: job '{args.job}' on {opt.address}; "
                  + (f"resumed at committed step {opt.committed_step}" if opt.resumed
                     else "new job"))
            poller = StatsPoller(opt)

        ft_before = evaluate(model, ft_data, args)
        base_before = evaluate(model, base_data, args)
        print(f"fine-tuning: {args.steps} steps on {ft_data.name} "
              f"({len(ft_data.train):,} training bytes) with {args.optimizer} AdamW; "
              f"held-out loss before {ft_before:.3f}")
        hist = train(model, opt, ft_data, args.steps, args.lr, args, desc="fine-tune",
                     seed=args.seed + 1, grad_clip=args.grad_clip, poller=poller,
                     eval_data=ft_data)
        ft_after = evaluate(model, ft_data, args)
        base_after = evaluate(model, base_data, args)

        metrics = {
            "job": args.job, "optimizer": args.optimizer, "model": args.model,
            "parameters": model.num_parameters(), "dtype": args.dtype,
            "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "finetune_loss_before": ft_before, "finetune_loss_after": ft_after,
            "base_loss_before": base_before, "base_loss_after": base_after,
            "finetune_seconds": hist["seconds"], "tokens_per_second": hist["tokens_per_second"],
        }
        final_stats = None
        if poller is not None:
            final_stats = poller.poll(force=True)
            moved = poller.bytes_since_start()
            loop = opt.loop_stats
            metrics["loop_stats"] = dataclasses.asdict(loop)
            metrics.update({"committed_step": opt.committed_step, "resumed": opt.resumed,
                            "ssd_bytes_read": moved[0] if moved else None,
                            "ssd_bytes_written": moved[1] if moved else None,
                            "daemon_stats": final_stats})

        # Checkpoint: the model and the optimizer's state_dict (for fuyou, what its
        # state_dict() returns; the states themselves stay in the fuyou job).
        ckpt_path = args.out_dir / "finetuned.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "model_preset": args.model, "args": {k: str(v) for k, v in vars(args).items()},
                    "metrics": {k: v for k, v in metrics.items() if k != "daemon_stats"}},
                   ckpt_path)
        png = args.out_dir / "loss.png"
        plot_losses(png, base_losses, hist, ft_before, ft_after,
                    title=f"fine-tuning (SQLite docs), {args.optimizer} AdamW")
        (args.out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str))

        if args.sample_bytes > 0:
            model.eval()
            prompt = tokenizer.encode("The sqlite3_prepare_v2() interface ").unsqueeze(0)
            gen = torch.Generator().manual_seed(args.seed)
            out = model.generate(prompt, args.sample_bytes, generator=gen)
            print("\nsample:\n" + tokenizer.decode(out[0]) + "\n")

        print("=" * 72)
        print(f"held-out loss on {ft_data.name}: {ft_before:.3f} -> {ft_after:.3f}  "
              f"(fine-tuning corpus)")
        print(f"held-out loss on {base_data.name}: {base_before:.3f} -> {base_after:.3f}  "
              f"(base corpus, forgetting)")
        print(f"fine-tuning: {args.steps} steps in {hist['seconds']:.1f} s, "
              f"{hist['tokens_per_second']:,.0f} tokens/s ({args.optimizer} AdamW)")
        if poller is not None:
            loop = metrics["loop_stats"]
            steps = max(loop["steps"], 1)
            print(f"speculation: {loop['speculative_updates']} chunk updates during backward; "
                  f"{loop['steps_with_redo']} of {loop['steps']} steps redone "
                  f"({100.0 * loop['steps_with_redo'] / steps:.0f}%: "
                  f"{loop['redone_clipped']} chunks clipped, {loop['redone_changed']} changed), "
                  f"redo {loop['redo_seconds']:.2f} s; fingerprints "
                  f"{1e3 * loop['fingerprint_seconds'] / steps:.2f} ms per step "
                  f"({1e3 * hist['seconds'] / args.steps:.1f} ms per step in all)")
            if metrics["ssd_bytes_read"] is not None:
                print(f"daemon storage traffic during fine-tuning: read "
                      f"{fmt_bytes(metrics['ssd_bytes_read'])}, written "
                      f"{fmt_bytes(metrics['ssd_bytes_written'])}")
            if final_stats and metrics["ssd_bytes_read"] == 0 and final_stats.get("cache_misses") == 0:
                print("(no reads: all optimizer states fit in the daemon's DRAM budget of "
                      f"{fmt_bytes(final_stats.get('dram_budget_bytes', 0))}; the writes are the "
                      "step commits. A model whose states exceed the budget reads them from SSD.)")
            if poller.error:
                print(f"note: last admin_stats error: {poller.error}")
            print(f"job '{args.job}': committed step {opt.committed_step}")
            print("daemon stats at the end:")
            print(json.dumps(final_stats, indent=2, default=str))
        print(f"saved {ckpt_path}, {png}, {args.out_dir / 'metrics.json'}")
    finally:
        if args.optimizer == "fuyou":
            opt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
