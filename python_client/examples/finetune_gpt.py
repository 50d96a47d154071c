#!/usr/bin/env python3
"""Fine-tunes a small Llama with fuyou.AdamW (optimizer states offloaded to fuyoud).

The model is a transformers LlamaForCausalLM built from a config file of
configs/ (--model picks configs/llama-<preset>.json; --model-config any
config.json), with random weights and a byte-level vocabulary (llama.py);
--arch gpt trains the example GPT of gpt.py instead.

What it does, with the defaults (about 2-4 minutes on 2 CPU cores):

  1. Base model: loads --checkpoint, or trains a fresh one for --base-steps on the
     base corpus (KJV Genesis + Exodus) with torch.optim.AdamW and saves it.
  2. Fine-tunes it for --steps on a different corpus (the SQLite C API reference)
     with fuyou.AdamW (or torch.optim.AdamW with --optimizer torch, to compare).
     A progress bar shows the loss, tokens/s and, with fuyou, the daemon's SSD
     read/write rates.
  3. Reports held-out loss before and after, tokens/s, the bytes the daemon read
     and wrote, and the daemon's final stats; saves a checkpoint (model +
     optimizer state_dict), a loss-curve PNG (loss.png), a step-timeline PNG
     (timeline.png) and metrics.json under --out-dir; the Llama also with
     save_pretrained (safetensors, <out-dir>/hf/), which the script loads back
     with AutoModelForCausalLM.from_pretrained and compares tensor by tensor.
  4. With fuyou: runs the first --compare-steps steps again with
     torch.optim.AdamW and prints a side-by-side table (tokens/s, SSD traffic,
     cache hit rate, the overlap achieved, redo counts; see summarize()).

The model trains on CUDA when torch.cuda.is_available(), else on the CPU
(--device). deploy/main-job.sh runs the 'main' preset (25.6M parameters) with
--daemon embedded --dram-budget 64MiB, so its optimizer states (307 MB) are 4.6x
the daemon's DRAM budget and stream from the SSD every step.

With --optimizer fuyou and the default --daemon auto, fuyou.AdamW decides whether
to use a running fuyoud or start a private one (the "embedded" daemon, whose
binary comes from $FUYOU_DAEMON, e.g. build/daemon/fuyoud). deploy/main-job.sh
runs this script with everything set up.

    .venv/bin/python python_client/examples/finetune_gpt.py --optimizer torch

--ddp: one rank of a data-parallel torchrun job (ddp_launch.py; README "The
main job"):

    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 \
        --redirects 9:1 --tee 9:1 python_client/examples/finetune_gpt.py --ddp
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import pathlib
import sys
import time
from typing import Dict, List, Optional

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ddp_launch  # noqa: E402
import llama  # noqa: E402
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
    p.add_argument("--arch", choices=["llama", "gpt"], default="llama",
                   help="llama: transformers' LlamaForCausalLM from a config file (llama.py); "
                        "gpt: the example GPT (gpt.py)")
    p.add_argument("--model", choices=sorted(set(PRESETS) | set(llama.PRESETS)), default="small",
                   help="size preset (--arch llama: configs/llama-<preset>.json)")
    p.add_argument("--model-config", type=pathlib.Path, default=None,
                   help="--arch llama: a Hugging Face config.json of a Llama to build instead "
                        "of the preset's")
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
    p.add_argument("--state-dtype", choices=["fp32", "bf16", "8bit"], default="fp32",
                   help="fuyou.AdamW(state_dtype=...): the dtype the daemon keeps Adam's "
                        "moments in (bf16: 8 bytes of states a parameter instead of 12)")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20,
                   help="fuyou chunk size in bytes; small so a tiny model has several chunks")
    p.add_argument("--daemon", choices=["auto", "embedded", "external"], default="auto",
                   help="fuyou.AdamW(embedded=None|True|False): auto uses a running fuyoud "
                        "and starts a private one when none answers; embedded always starts "
                        "one (its states go to $FUYOU_DATA_DIR, default ./fuyou-data)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the model trains: auto = cuda when torch.cuda.is_available()")
    p.add_argument("--dram-budget", default="64MiB",
                   help="--daemon embedded: the embedded fuyoud's --dram-budget (DRAM for "
                        "optimizer states). fuyoud's smallest: the 'main' model's states "
                        "(305 MB) are 4.5x this, so they stream from the SSD every step. "
                        "'' = the daemon's default (2GiB)")
    p.add_argument("--commit-every", type=int, default=0,
                   help="--daemon embedded: pass --commit-every-steps N to the embedded "
                        "fuyoud (a durable step every N steps; needs a fuyoud that has the "
                        "flag); 0 = the daemon's default")
    p.add_argument("--serial-steps", type=int, default=5,
                   help="fuyou: steps 2..N+1 run with overlap off (opt.overlap = False) to "
                        "measure the optimizer's own time; the overlap achieved is computed "
                        "from them; 0 = none (no overlap figure)")
    p.add_argument("--compare-steps", type=int, default=30,
                   help="fuyou: then run this many of the same steps with torch.optim.AdamW "
                        "(states in RAM) from the same weights, for the tokens/s comparison; "
                        "0 = none")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation")
    p.add_argument("--eval-every", type=int, default=50, help="evaluate every N fine-tuning steps")
    p.add_argument("--sample-bytes", type=int, default=200,
                   help="bytes to sample from the fine-tuned model at the end; 0 = none")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 = torch's default")
    p.add_argument("--daemon-threads", type=int, default=0,
                   help="--daemon embedded: the embedded fuyoud's optimizer worker threads "
                        "(--threads); 0 = as fuyou.AdamW's embedded daemon: on the CPU the "
                        "cores torch leaves (at least 1), else fuyoud's default, all cores")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ddp", action="store_true",
                   help="data parallel, one rank of a torchrun job (.venv/bin/python -m "
                        "torch.distributed.run --nproc_per_node=N finetune_gpt.py --ddp ...): "
                        "gloo on the CPU, nccl on CUDA, the model in DistributedDataParallel, "
                        "each rank its own batches (the global batch is N x --batch-size); "
                        "fuyou.AdamW shards its states over the ranks (jobs "
                        "<job>.rank<r>-of<N>) and the ranks of a node share one fuyoud (local "
                        "rank 0 starts it with --daemon embedded); rank 0 prints and writes "
                        "the outputs; no torch comparison (see ddp_launch.py)")
    p.add_argument("--ddp-model", choices=["ddp", "plain"], default="ddp",
                   help="--ddp: ddp = the model in DistributedDataParallel (DDP's all-reduce "
                        "averages the gradients; fuyou sees it and reduces nothing); plain = "
                        "no wrapper: fuyou.AdamW reduces each chunk to the rank that owns it "
                        "during backward and that rank's update overlaps the rest of backward")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar (log lines instead)")
    args = p.parse_args(argv)
    if args.arch == "llama":
        if args.model_config is None:
            if args.model not in llama.PRESETS:
                p.error(f"--model {args.model}: no configs/llama-{args.model}.json")
            args.model_config = llama.config_path(args.model)
        args.block_size = int(llama.load_config(args.model_config).max_position_embeddings)
    else:
        if args.model_config is not None or args.model not in PRESETS:
            p.error("--arch gpt takes a --model of gpt.py's presets and no --model-config")
        args.block_size = PRESETS[args.model].block_size
    if args.seq_len > args.block_size:
        p.error(f"--seq-len {args.seq_len} exceeds the model's block size {args.block_size}")
    if args.out_dir is None:
        args.out_dir = pathlib.Path("runs") / args.job
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    if args.commit_every < 0 or args.serial_steps < 0 or args.compare_steps < 0:
        p.error("--commit-every, --serial-steps and --compare-steps must be >= 0")
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
    losses = [model(x.to(args.device), y.to(args.device))[1].item()
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
        # fused=True: torch 2's fastest AdamW, on the CPU (2.4+) as on CUDA (the peer
        # fuyou's figures are measured against; benchmarks/adamw_vs_torch.py).
        return torch.optim.AdamW(params, fused=True, **hyper)
    fuyou = import_fuyou()
    embedded = {"auto": None, "embedded": True, "external": False}[args.daemon]
    extra = {"max_grad_norm": grad_clip} if grad_clip > 0 and args.clip_with == "optimizer" else {}
    if getattr(args, "daemon_address", None):  # the embedded fuyoud main() started
        extra["address"], embedded = args.daemon_address, False
    if getattr(args, "state_dtype", "fp32") != "fp32":
        extra["state_dtype"] = args.state_dtype
    return fuyou.AdamW(params, job=job, chunk_bytes=args.chunk_bytes, embedded=embedded,
                       overlap=not args.no_overlap, **extra, **hyper)


def start_embedded_daemon(args):
    """--daemon embedded: starts the private fuyoud with --dram-budget and
    --commit-every-steps from the options (fuyou.AdamW(embedded=True) would start
    one with the daemon's defaults); returns it, or None for auto/external."""
    if args.daemon != "embedded" or "fuyou" not in (args.optimizer, args.base_optimizer):
        return None
    if not ddp_launch.node_leader(args):  # --ddp: the node's one fuyoud is local rank 0's
        return None
    fuyou = import_fuyou()
    extra = []
    if args.dram_budget:
        extra += ["--dram-budget", args.dram_budget]
    if args.commit_every > 0:
        extra += ["--commit-every-steps", str(args.commit_every)]
    threads = args.daemon_threads
    if threads == 0 and args.device == "cpu":  # as fuyou.AdamW's own embedded daemon
        threads = fuyou.daemon.threads_beside_cpu_training(torch.get_num_threads())
    if threads > 0:
        extra += ["--threads", str(threads)]
    daemon = fuyou.EmbeddedDaemon(extra_args=extra)
    args.daemon_address = daemon.address
    args.daemon_pid = daemon.pid
    return daemon


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

def process_cpu_seconds(pid: Optional[int]) -> Optional[float]:
    """User + system CPU seconds of process `pid` so far (all its threads), from
    /proc; None without a pid or a /proc entry."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def train(model: GPT, opt, data: TextDataset, steps: int, peak_lr: float, args,
          desc: str, seed: int, grad_clip: float, poller: Optional[StatsPoller] = None,
          eval_data: Optional[TextDataset] = None, serial: int = 0,
          total_steps: Optional[int] = None) -> Dict[str, list]:
    """Runs `steps` optimizer steps; returns the loss history and per-step timers.

    The learning rate is set before backward: fuyou.AdamW sends each chunk's
    update, with the group's lr at that moment, while backward runs. With
    fuyou.AdamW, steps 2..serial+1 run with opt.overlap = False: nothing is sent
    during backward, so their step() time is the optimizer's whole time (update +
    SSD I/O) for a step. Timers per step: fb_s (forward + backward), opt_s (clip +
    step()), step_s (the whole iteration); on CUDA each is synchronized."""
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(seed)
    tokens_per_step = args.batch_size * args.seq_len * ddp_launch.world_size(args)
    history = {"step": [], "loss": [], "eval_step": [], "eval_loss": [],
               "fb_s": [], "opt_s": [], "step_s": [], "serial": [], "read_gbps": [],
               "write_gbps": [], "client_cpu_s": [], "daemon_cpu_s": []}
    daemon_pid = getattr(args, "daemon_pid", None) if hasattr(opt, "overlap") else None
    serial_steps = set(range(1, 1 + serial)) if hasattr(opt, "overlap") else set()
    cuda = args.device.startswith("cuda")
    bar = tqdm(range(steps), desc=desc, unit="step", dynamic_ncols=True,
               disable=args.no_progress, file=sys.stdout)
    t0 = time.perf_counter()
    for i in bar:
        t_start = time.perf_counter()
        cpu_start = (time.process_time(), process_cpu_seconds(daemon_pid))
        if serial_steps:
            opt.overlap = not args.no_overlap and i not in serial_steps
        lr = lr_at(i, total_steps or steps, peak_lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = data.train_batch(args.batch_size, args.seq_len, gen)
        x, y = x.to(args.device), y.to(args.device)
        t_fb = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        t_opt = time.perf_counter()
        if grad_clip > 0 and (isinstance(opt, torch.optim.AdamW) or args.clip_with == "external"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        t_end = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        history["fb_s"].append(t_opt - t_fb)
        history["opt_s"].append(t_end - t_opt)
        history["step_s"].append(t_end - t_start)
        history["serial"].append(i in serial_steps)
        history["client_cpu_s"].append(time.process_time() - cpu_start[0])
        daemon_cpu = process_cpu_seconds(daemon_pid)
        history["daemon_cpu_s"].append(None if daemon_cpu is None or cpu_start[1] is None
                                       else daemon_cpu - cpu_start[1])

        history["step"].append(i + 1)
        history["loss"].append(loss.item())
        elapsed = time.perf_counter() - t0
        postfix = {"loss": f"{loss.item():.3f}",
                   "tok/s": f"{tokens_per_step * (i + 1) / elapsed:,.0f}"}
        if poller is not None:
            poller.poll()
            rates = poller.rates_gbps()
            postfix["ssd R/W GB/s"] = "n/a" if rates is None else f"{rates[0]:.2f}/{rates[1]:.2f}"
            history["read_gbps"].append(rates[0] if rates else 0.0)
            history["write_gbps"].append(rates[1] if rates else 0.0)
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
    if ddp_launch.is_main(args):  # --ddp: every rank trained the same base model
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


def _mean(values: List[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def _available_memory(device: str) -> int:
    """Bytes free for torch.optim.AdamW's states: the GPU's free memory, or the
    machine's MemAvailable."""
    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def run_torch_comparison(model: GPT, start_weights: dict, data: TextDataset, args) -> dict:
    """The first --compare-steps fine-tuning steps again with torch.optim.AdamW
    (states in RAM, or on the GPU), from the same weights, batches and lr schedule,
    on a twin of the model; returns its tokens/s, or why it did not run."""
    steps = min(args.compare_steps, args.steps)
    if args.ddp:
        return {"ran": False, "why": "--ddp (torch.optim.AdamW would step each rank alone)"}
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    need = 2 * param_bytes  # exp_avg and exp_avg_sq, in the weights' dtype
    free = _available_memory(args.device)
    if steps == 0:
        return {"ran": False, "why": "--compare-steps 0"}
    if need > free:
        return {"ran": False, "why": f"its states ({fmt_bytes(need)}) would not fit in the "
                                      f"{fmt_bytes(free)} free on {args.device}"}
    # A twin of the model from the same start: the fuyou model keeps its weights
    # and fuyou.AdamW's hooks see none of these steps.
    twin = build_model(args).to(device=args.device, dtype=next(model.parameters()).dtype)
    twin.load_state_dict(start_weights)
    opt = make_optimizer("torch", twin.parameters(), args.lr, args, job="", grad_clip=args.grad_clip)
    hist = train(twin, opt, data, steps, args.lr, args, desc="torch AdamW", seed=args.seed + 1,
                 grad_clip=args.grad_clip, total_steps=args.steps)
    del twin, opt
    steady = hist["step_s"][1:] or hist["step_s"]
    tokens = args.batch_size * args.seq_len
    return {"ran": True, "steps": steps, "state_bytes": need,
            "tokens_per_second": tokens * len(steady) / sum(steady),
            "client_cpu_s": _mean(hist["client_cpu_s"][1:] or hist["client_cpu_s"]),
            "loss_at_last_step": hist["loss"][-1]}


def summarize(args, model: GPT, hist: Dict[str, list], metrics: dict,
              poller: StatsPoller, compare: dict) -> dict:
    """The figures of the side-by-side table (see format_summary), from the
    example's own per-step timers, the daemon's GetStats and opt.loop_stats.

    Overlap: T_fb and T_opt are the mean forward+backward and step() times of the
    serial steps (overlap off: step() does the whole update and its SSD I/O after
    backward); T_step is the mean forward+backward+step() time of the overlapped
    steps (the others, less the first step and the one after the serial ones).
    overlap = (T_fb + T_opt) / T_step: 1.0 = nothing overlapped; the optimizer
    time hidden behind backward is (T_fb + T_opt - T_step) / T_opt."""
    tokens = args.batch_size * args.seq_len
    n = len(hist["step_s"])
    serial_idx = [i for i in range(n) if hist["serial"][i]]
    after = (serial_idx[-1] + 2) if serial_idx else 1
    overlapped_idx = [i for i in range(after, n)] or list(range(n))
    ov_step = [hist["fb_s"][i] + hist["opt_s"][i] for i in overlapped_idx]
    t_step = _mean(ov_step)
    t_fb = _mean([hist["fb_s"][i] for i in serial_idx])
    t_opt = _mean([hist["opt_s"][i] for i in serial_idx])
    overlap = hidden = None
    if t_fb is not None and t_opt is not None and t_step:
        overlap = (t_fb + t_opt) / t_step
        hidden = max(0.0, min(1.0, (t_fb + t_opt - t_step) / t_opt)) if t_opt > 0 else None
    stats = poller.latest or {}
    base = getattr(poller, "_baseline", None) or {}
    hits = stats.get("cache_hits", 0) - base.get("cache_hits", 0)
    misses = stats.get("cache_misses", 0) - base.get("cache_misses", 0)
    steady_s = [hist["step_s"][i] for i in overlapped_idx]
    cpu = {}
    for side in ("client", "daemon"):
        for name, idx in (("serial", serial_idx), ("overlapped", overlapped_idx)):
            values = [hist[f"{side}_cpu_s"][i] for i in idx]
            cpu[f"{side}_cpu_s_{name}"] = None if not values or None in values else _mean(values)
    return {
        "device": args.device, "parameters": model.num_parameters(),
        # fp32 master weights, m, v (bf16 m and v with --state-dtype bf16; 8-bit
        # codes and a scale per 256 with 8bit)
        "fuyou_state_bytes": int({"bf16": 8, "8bit": 4 + 2 * (1 + 4 / 256)}.get(args.state_dtype, 12)
                                 * model.num_parameters()),
        "state_dtype": args.state_dtype,
        "dram_budget_bytes": stats.get("dram_budget_bytes"),
        "steps": n, "serial_steps": len(serial_idx),
        "fuyou_tokens_per_second": hist["tokens_per_second"],
        "fuyou_tokens_per_second_overlapped": tokens * len(steady_s) / sum(steady_s),
        "torch": compare,
        "ssd_bytes_read": metrics.get("ssd_bytes_read"),
        "ssd_bytes_written": metrics.get("ssd_bytes_written"),
        "cache_hits": hits, "cache_misses": misses,
        "cache_hit_rate": hits / (hits + misses) if hits + misses else None,
        "t_fb_s": t_fb, "t_opt_s": t_opt, "t_step_overlapped_s": t_step,
        "overlap": overlap, "optimizer_time_hidden": hidden,
        "loop_stats": metrics.get("loop_stats"),
        "cpu_per_step": cpu, "cpu_cores": os.cpu_count(),
    }


def format_summary(s: dict) -> str:
    """The side-by-side table: fuyou.AdamW and torch.optim.AdamW. The cache hit
    rate is GetStats' (cache_hits / (cache_hits + cache_misses) during the run);
    'SSD read per step' is the share of the states actually read from storage."""
    def gb(v):
        return "n/a" if v is None else f"{v / 1e9:.2f} GB"

    t = s["torch"]
    budget = s["dram_budget_bytes"]
    ratio = f" = {s['fuyou_state_bytes'] / budget:.1f}x the budget" if budget else ""
    rows = [
        ("", "fuyou.AdamW", "torch.optim.AdamW"),
        ("optimizer states", f"{fmt_bytes(s['fuyou_state_bytes'])} "
         f"({ {'bf16': 'fp32 w, bf16 m, v', '8bit': 'fp32 w, 8-bit m, v'}.get(s.get('state_dtype'), 'fp32 w, m, v')})",
         f"{fmt_bytes(t['state_bytes'])} (m, v)" if t.get("ran") else "-"),
        ("where", f"SSD; {fmt_bytes(budget or 0)} DRAM budget{ratio}", f"{s['device']} memory"),
        ("steps measured", f"{s['steps']} ({s['serial_steps']} with overlap off)",
         f"{t['steps']} (same batches)" if t.get("ran") else "-"),
        ("tokens/s, all steps", f"{s['fuyou_tokens_per_second']:,.0f}", "-"),
        ("tokens/s, steady", f"{s['fuyou_tokens_per_second_overlapped']:,.0f}",
         f"{t['tokens_per_second']:,.0f}" if t.get("ran") else f"not run: {t['why']}"),
        ("SSD read / written", f"{gb(s['ssd_bytes_read'])} / {gb(s['ssd_bytes_written'])}", "0 / 0"),
        ("SSD read per step", "n/a" if not s["ssd_bytes_read"] else
         f"{s['ssd_bytes_read'] / s['steps'] / 1e6:,.0f} MB = "
         f"{100 * s['ssd_bytes_read'] / s['steps'] / s['fuyou_state_bytes']:.0f}% of the states",
         "-"),
        ("cache hit rate", "n/a" if s["cache_hit_rate"] is None else
         f"{100 * s['cache_hit_rate']:.1f}% ({s['cache_hits']:,} hits, {s['cache_misses']:,} misses)",
         "-"),
    ]
    if s["overlap"] is not None:
        rows.append(("overlap (fb+opt)/step",
                     f"{s['overlap']:.2f}x: {1e3 * s['t_fb_s']:.0f} + {1e3 * s['t_opt_s']:.0f} ms "
                     f"-> {1e3 * s['t_step_overlapped_s']:.0f} ms "
                     f"({100 * (s['optimizer_time_hidden'] or 0):.0f}% of optimizer time hidden)",
                     "-"))
    else:
        rows.append(("overlap (fb+opt)/step", "n/a (no serial steps)", "-"))
    cpu = s.get("cpu_per_step") or {}
    if cpu.get("client_cpu_s_overlapped") is not None and cpu.get("daemon_cpu_s_overlapped") is not None:
        rows.append(("CPU a step (overlapped)",
                     f"client {1e3 * cpu['client_cpu_s_overlapped']:.0f} + fuyoud "
                     f"{1e3 * cpu['daemon_cpu_s_overlapped']:.0f} ms on {s['cpu_cores']} cores "
                     f"(overlap off: {1e3 * (cpu['client_cpu_s_serial'] or 0):.0f} + "
                     f"{1e3 * (cpu['daemon_cpu_s_serial'] or 0):.0f})",
                     f"{1e3 * t['client_cpu_s']:.0f} ms" if t.get("ran") and t.get("client_cpu_s") else "-"))
    loop = s.get("loop_stats") or {}
    if loop:
        rows.append(("redo (loop_stats)",
                     f"{loop['steps_with_redo']}/{loop['steps']} steps, "
                     f"{loop['redone_clipped']} clipped + {loop['redone_changed']} changed chunks, "
                     f"{loop['redo_seconds']:.2f} s", "-"))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = ["=" * 72, "main job: fuyou.AdamW vs torch.optim.AdamW"]
    lines += [f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
    lines.append("overlap = (T_fb + T_opt) / T_step: T_fb, T_opt = forward+backward and step() "
                 "time with overlap off; T_step = forward+backward+step() with overlap on")
    return "\n".join(lines)


def plot_timeline(path: pathlib.Path, hist: Dict[str, list], title: str) -> None:
    """Per step: forward+backward and step() time (stacked; overlap-off steps
    hatched), and the daemon's SSD read/write GB/s."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = hist["step"]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    fb = [1e3 * v for v in hist["fb_s"]]
    op = [1e3 * v for v in hist["opt_s"]]
    hatch = ["//" if s else "" for s in hist["serial"]]
    ax.bar(steps, fb, width=1.0, label="forward + backward", color="tab:blue")
    bars = ax.bar(steps, op, width=1.0, bottom=fb, label="step() (optimizer wait)",
                  color="tab:orange")
    for b, h in zip(bars, hatch):
        b.set_hatch(h)
    ax.set(title=title + " (hatched: overlap off)", ylabel="ms")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    if hist["read_gbps"]:
        ax2.plot(steps, hist["read_gbps"], label="SSD read GB/s")
        ax2.plot(steps, hist["write_gbps"], label="SSD write GB/s")
        ax2.legend(loc="upper right")
    ax2.set(xlabel="step", ylabel="GB/s")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n):,} B"
        n /= 1024
    return str(n)


def build_model(args):
    """The model of --arch and --model (--model-config), random weights from the
    global torch generator."""
    if args.arch == "llama":
        return llama.LlamaLM(llama.load_config(args.model_config))
    return GPT(PRESETS[args.model])


def save_hf(model, directory: pathlib.Path) -> dict:
    """--arch llama: the model with save_pretrained (safetensors) into `directory`,
    loaded back with AutoModelForCausalLM.from_pretrained and compared with the
    trained weights tensor by tensor; raises if anything differs."""
    import transformers
    model.hf.save_pretrained(directory)
    back = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=model.hf.dtype)
    mine = model.hf.state_dict()
    theirs = back.state_dict()
    differ = [k for k, v in mine.items() if k not in theirs or not torch.equal(v.cpu(), theirs[k])]
    if differ or set(theirs) != set(mine):
        raise RuntimeError(f"from_pretrained({directory}) does not give the trained weights: "
                           f"{differ[:3] or sorted(set(theirs) ^ set(mine))[:3]}")
    files = sorted(p.name for p in directory.iterdir())
    return {"directory": str(directory), "files": files, "tensors": len(theirs),
            "architecture": type(back).__name__}


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.ddp:
        ddp_launch.join(args)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    dtype = DTYPES[args.dtype]
    tokenizer = ByteTokenizer()

    model = build_model(args).to(args.device)
    print(f"model: {args.arch} {args.model}, {model.num_parameters():,} parameters, {args.dtype}, on "
          f"{args.device}; batch {args.batch_size} x {args.seq_len} tokens; torch "
          f"{torch.__version__}, {torch.get_num_threads()} thread(s)")
    daemon = start_embedded_daemon(args)
    try:
        return _run(args, model, dtype, tokenizer)
    finally:
        if daemon is not None:
            daemon.stop()  # after opt.close(): its barrier waits for every rank's close
        ddp_launch.leave(args)


def _run(args, model: GPT, dtype, tokenizer: ByteTokenizer) -> int:

    base_losses: List[float] = []
    if args.checkpoint is not None:
        ckpt = torch.load(args.checkpoint, map_location=args.device)
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
    start_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}

    trained = ddp_launch.wrap(model, args)  # --ddp: DistributedDataParallel
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
        hist = train(trained, opt, ft_data, args.steps, args.lr, args, desc="fine-tune",
                     seed=ddp_launch.rank_seed(args.seed + 1, args), grad_clip=args.grad_clip, poller=poller,
                     eval_data=ft_data,
                     serial=min(args.serial_steps, max(args.steps - 3, 0))
                     if args.optimizer == "fuyou" and not args.no_overlap else 0)
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
        summary = None
        if args.optimizer == "fuyou":
            compare = run_torch_comparison(model, start_weights, ft_data, args)
            summary = summarize(args, model, hist, metrics, poller, compare)
            metrics["summary"] = summary
        ckpt_path = args.out_dir / "finetuned.pt"
        # With --ddp a collective: every rank's moments in the full state dict of every rank.
        optimizer_state = opt.state_dict()
        if not ddp_launch.is_main(args):
            return 0
        torch.save({"model": model.state_dict(), "optimizer": optimizer_state,
                    "model_preset": args.model, "args": {k: str(v) for k, v in vars(args).items()},
                    "metrics": {k: v for k, v in metrics.items() if k != "daemon_stats"}},
                   ckpt_path)
        hf_saved = save_hf(model, args.out_dir / "hf") if args.arch == "llama" else None
        metrics["hf_checkpoint"] = hf_saved
        png = args.out_dir / "loss.png"
        plot_losses(png, base_losses, hist, ft_before, ft_after,
                    title=f"fine-tuning (SQLite docs), {args.optimizer} AdamW")
        timeline_png = args.out_dir / "timeline.png"
        plot_timeline(timeline_png, hist, title=f"step timeline, {args.optimizer} AdamW "
                      f"({args.model}, {args.device})")
        (args.out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str))

        if args.sample_bytes > 0:
            model.eval()
            model.to("cpu")  # sampled with a CPU generator
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
        if summary is not None:
            print(format_summary(summary))
        print(f"saved {ckpt_path}, {png}, {timeline_png}, {args.out_dir / 'metrics.json'}")
        if hf_saved is not None:
            print(f"saved {hf_saved['directory']} with save_pretrained ({', '.join(hf_saved['files'])});"
                  f" AutoModelForCausalLM.from_pretrained loads it: {hf_saved['architecture']}, "
                  f"{hf_saved['tensors']} tensors equal to the trained ones")
    finally:
        if args.optimizer == "fuyou":
            opt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
