#!/usr/bin/env python3
"""GPU check of issue 10: fuyou.AdamW (default overlap=True) under the real
torch.cuda.amp.GradScaler loop and the real transformers.Trainer, against
torch.optim.AdamW.

    FUYOU_DAEMON=$PWD/build/daemon/fuyoud PYTHONPATH=$PWD/python_client \\
        python3 tests/gpu/check_loops_gpu.py

(needs `ninja -C build fuyoud _fuyou`, CUDA, and transformers with accelerate).

Checks, each comparing every weight after every optimizer step with
|a - b| <= 1e-6 + 1e-5 |b| (b: the torch.optim.AdamW run, same initial weights,
same data, same kernels):
  1. gradscaler: fp32 weights, torch.autocast(fp16) forward,
     torch.cuda.amp.GradScaler: scale(loss).backward(), unscale_(opt),
     clip_grad_norm_(1.0), scaler.step(opt), scaler.update(), zero_grad();
     an inf injected into one gradient in one step, which GradScaler skips;
     then the same loop with the model streamed (offload_params, issue 19).
  2. trainer: transformers.Trainer on a small LlamaForCausalLM built from a
     config (no download), optimizers=(opt, LambdaLR warmup), max_grad_norm=1.0,
     gradient_accumulation_steps=2, a few steps; the weights are snapshotted
     after each step by a TrainerCallback; then the same Trainer with the model
     streamed (offload_params, issue 19).
Prints the largest weight difference per step and fuyou's loop_stats; exits 1
when a check is beyond the tolerance, 2 when fuyou cannot run here (no daemon
binary or binding), and 0 printing "skipped: no GPU" or "skipped: no
transformers" where CUDA or transformers is missing.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "python_client") not in sys.path:
    sys.path.insert(0, str(REPO / "python_client"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fuyou  # noqa: E402

RTOL = 1e-5
ATOL = 1e-6
LR = 1e-3
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
CHUNK_BYTES = 96 << 10  # several chunks, biases and norms sharing them with matrices
NUM_SLOTS = 2


# --------------------------------------------------------------- comparison
class Compare:
    """Collects, per check and step, the largest weight difference and whether
    every weight is within ATOL + RTOL * |b|."""

    def __init__(self):
        self.failures = []

    def weights(self, check, step, got, want):
        worst, ok, worst_name = 0.0, True, ""
        for name, a in got.items():
            b = want[name]
            err = (a.double() - b.double()).abs()
            e = err.max().item() if err.numel() else 0.0
            if e > worst or e != e:
                worst, worst_name = e, name
            ok &= bool((err <= ATOL + RTOL * b.double().abs()).all())
        print(f"  {check} step {step}: max |w_fuyou - w_torch| = {worst:.3g} ({worst_name})"
              f"{'' if ok else '  BEYOND TOLERANCE'}")
        if not ok:
            self.failures.append(f"{check} step {step}: {worst:.3g} in {worst_name}")


def snapshot(model):
    """The weights by parameter name (a streamed model's state_dict() fetches
    them from the daemon)."""
    names = {n for n, _ in model.named_parameters()}
    return {n: t.detach().float().cpu().clone() for n, t in model.state_dict().items()
            if n in names}


def print_loop_stats(opt):
    stats = getattr(opt, "loop_stats", None)
    print(f"  fuyou loop_stats: {stats if stats is not None else 'absent (issue 10 not in)'}")


def new_fuyou(daemon, params, job, **kw):
    return fuyou.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, job=job,
                       address=daemon.address, chunk_bytes=CHUNK_BYTES, num_slots=NUM_SLOTS,
                       timeout=60.0, **kw)


def new_torch(params):
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)


# ---------------------------------------------------------------- GradScaler
class SmallNet(nn.Module):
    def __init__(self, vocab=256, dim=64):
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.ln = nn.LayerNorm(4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx, targets):
        x = self.emb(idx)
        x = x + self.fc2(F.gelu(self.ln(self.fc1(x))))
        logits = self.head(x)
        return F.cross_entropy(logits.float().reshape(-1, self.vocab), targets.reshape(-1))


def check_gradscaler(daemon, compare, steps=8, inf_at=3, streamed=False):
    """`streamed`: fuyou with offload_params + stream_parameters (issue 19): the
    gradients are freed once sent; GradScaler's unscale_ and the clip work on
    their FreedGrads and are replayed on the daemon's journal."""
    check = "gradscaler-streamed" if streamed else "gradscaler"
    print(f"{check}: torch.cuda.amp.GradScaler, fp16 autocast, clip_grad_norm_(1.0)")
    torch.manual_seed(0)
    ref = SmallNet().cuda()
    model = copy.deepcopy(ref)
    fuyou_opt = new_fuyou(daemon, model.parameters(), f"gpu-{check}-{os.getpid()}",
                          offload_params=streamed)
    stream = fuyou.stream_parameters(model, fuyou_opt) if streamed else None
    runs = {}
    for name, m, opt in (("torch", ref, new_torch(ref.parameters())),
                         ("fuyou", model, fuyou_opt)):
        scaler = torch.cuda.amp.GradScaler(init_scale=2.0 ** 12, growth_interval=3)
        snaps, skipped = [], []
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            data = torch.randint(0, m.vocab, (16, 33), generator=g).cuda()
            handle = None
            if step == inf_at:
                handle = m.fc1.weight.register_hook(lambda t: torch.full_like(t, float("inf")))
            with torch.autocast("cuda", dtype=torch.float16):
                loss = m(data[:, :-1], data[:, 1:])
            scaler.scale(loss).backward()
            if handle is not None:
                handle.remove()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            scale_before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < scale_before)
            opt.zero_grad(set_to_none=True)
            snaps.append(snapshot(m))
        if name == "fuyou":
            print_loop_stats(opt)
            if stream is not None:
                stream.close()
            opt.close()
        runs[name] = (snaps, skipped)
    print(f"  steps skipped by GradScaler: torch {runs['torch'][1]}, fuyou {runs['fuyou'][1]}")
    if runs["torch"][1] != runs["fuyou"][1] or not runs["torch"][1][inf_at]:
        compare.failures.append(f"{check}: the skipped steps differ or the inf was not seen")
    for step, (got, want) in enumerate(zip(runs["fuyou"][0], runs["torch"][0])):
        compare.weights(check, step, got, want)


# ---------------------------------------------------------------- Trainer
def check_trainer(daemon, compare, steps=6, k=2, batch=4, seq=32, streamed=False):
    """`streamed`: the fuyou model streamed (offload_params + stream_parameters):
    the Trainer's clip and its undeclared accumulation passes go through the
    FreedGrads and the daemon's gradient journal (issue 19)."""
    from torch.utils.data import Dataset, SequentialSampler
    from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,
                              TrainingArguments)

    check = "trainer-streamed" if streamed else "trainer"
    print(f"{check}: transformers.Trainer, small Llama, max_grad_norm=1.0, "
          "gradient_accumulation_steps=2")
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=seq, tie_word_embeddings=False,
                         attn_implementation="eager")  # deterministic attention backward
    try:
        config._attn_implementation = "eager"  # older versions ignore the keyword
    except AttributeError:
        pass
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).cuda()

    class Tokens(Dataset):
        def __len__(self):
            return steps * k * batch

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(10_000 + i)
            ids = torch.randint(0, config.vocab_size, (seq,), generator=g)
            return {"input_ids": ids, "labels": ids.clone(),
                    "attention_mask": torch.ones(seq, dtype=torch.long)}

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    class Snapshots(TrainerCallback):
        def __init__(self):
            self.snaps = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.snaps.append(snapshot(model))

    def warmup(step):
        return min(1.0, (step + 1) / 3)

    runs = {}
    for name in ("torch", "fuyou"):
        model = copy.deepcopy(base)
        opt = (new_torch(model.parameters()) if name == "torch" else
               new_fuyou(daemon, model.parameters(), f"gpu-{check}-{os.getpid()}",
                         offload_params=streamed))
        stream = (fuyou.stream_parameters(model, opt)
                  if streamed and name == "fuyou" else None)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
        snaps = Snapshots()
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(
                output_dir=out, per_device_train_batch_size=batch,
                gradient_accumulation_steps=k, max_steps=steps, max_grad_norm=1.0,
                learning_rate=LR, weight_decay=WEIGHT_DECAY, save_strategy="no",
                report_to="none", seed=0, disable_tqdm=True, dataloader_num_workers=0,
                remove_unused_columns=False, logging_steps=1)
            trainer = InOrder(model=model, args=args, train_dataset=Tokens(),
                              optimizers=(opt, sched), callbacks=[snaps])
            result = trainer.train()
        print(f"  {name}: training loss {result.training_loss:.6f}, "
              f"{len(snaps.snaps)} steps")
        if name == "fuyou":
            print_loop_stats(opt)
            if stream is not None:
                stream.close()
            opt.close()
        runs[name] = snaps.snaps
    if len(runs["fuyou"]) != steps or len(runs["torch"]) != steps:
        compare.failures.append(f"{check}: {len(runs['fuyou'])} fuyou and "
                                f"{len(runs['torch'])} torch steps, want {steps}")
    for step, (got, want) in enumerate(zip(runs["fuyou"], runs["torch"])):
        compare.weights(check, step, got, want)


def main() -> int:
    if not torch.cuda.is_available():
        print("skipped: no GPU (torch.cuda.is_available() is False); nothing checked")
        return 0
    if importlib.util.find_spec("transformers") is None:
        print("skipped: no transformers (pip install transformers accelerate); nothing checked")
        return 0
    try:
        binary = fuyou.find_daemon_binary()
        import fuyou._fuyou  # noqa: F401
    except (fuyou.FuyouError, ImportError) as e:
        print(f"error: fuyou cannot run here: {e}; build it with "
              "`ninja -C build fuyoud _fuyou` and set FUYOU_DAEMON / PYTHONPATH")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}, fuyoud {binary}")
    compare = Compare()
    with tempfile.TemporaryDirectory(prefix="fuyou-gpu-check-") as tmp:
        daemon = fuyou.EmbeddedDaemon(data_dir=os.path.join(tmp, "data"),
                                      socket_path=os.path.join(tmp, "d.sock"),
                                      extra_args=["--dram-budget", "1GiB"], binary=binary)
        try:
            check_gradscaler(daemon, compare)
            check_gradscaler(daemon, compare, streamed=True)
            check_trainer(daemon, compare)
            check_trainer(daemon, compare, streamed=True)
        finally:
            daemon.stop()
    if compare.failures:
        print("FAILED: beyond |a - b| <= 1e-6 + 1e-5 |b|:\n  " + "\n  ".join(compare.failures))
        return 1
    print("passed: every step of both checks within |a - b| <= 1e-6 + 1e-5 |b|")
    return 0


if __name__ == "__main__":
    sys.exit(main())
