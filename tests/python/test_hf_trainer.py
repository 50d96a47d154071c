"""Hugging Face models under transformers.Trainer (issue 34, item 1, the
resident mode): ``Trainer(model, args, optimizers=(fuyou.AdamW(...),
scheduler))`` against the same Trainer with ``torch.optim.AdamW``, every
weight compared after every optimizer step (``|a - b| <= 1e-6 + 1e-5 |b|``).

The models are built from configs with random weights (nothing is
downloaded): Llama (untied embeddings), GPT-2 (tied) and a small Mixtral
(mixture of experts: an expert that gets no token in a step has no gradient,
and torch leaves it alone). The Trainer clips (``max_grad_norm``),
accumulates (``gradient_accumulation_steps``) and steps a warm-up + cosine
schedule; fuyou is given the same scheduler object kind, made over it.

The mixture of experts amplifies rounding: its router's top-1 choice and
Adam's division by sqrt(v) of near-zero gradients turn last-bit differences of
one step into more in the next. torch's own two CPU implementations (foreach
and fused) already differ beyond the tolerance there by step 2, so for it each
step's largest difference from torch's foreach AdamW must be within the
tolerance or within twice the difference torch's fused AdamW shows.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import fuyou  # noqa: E402

ATOL, RTOL = 1e-6, 1e-5
LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1
STEPS = 4
_jobs = itertools.count()


def tiny(kind: str):
    """A model of `kind` with random weights from a small config (fp32)."""
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=32,
                                       tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(cfg)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=8,
                                     num_experts_per_tok=1, max_position_embeddings=32,
                                     router_aux_loss_coef=0.0)
    return transformers.MixtralForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    """Fixed random sequences: input_ids and labels (the model shifts them)."""

    def __init__(self, n=16, seq=12, vocab=64):
        g = torch.Generator().manual_seed(7)
        self.data = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


class WeightsAfterEachStep(transformers.TrainerCallback):
    def __init__(self, model):
        self.model, self.weights = model, []

    def on_step_end(self, args, state, control, **kwargs):
        # model.state_dict(): a streamed model's weights come from fuyoud
        self.weights.append([t.detach().clone() for t in self.model.state_dict().values()])


def train(kind, make_optimizer, tmp_path, max_steps=STEPS, save_steps=0, resume=None):
    """The Trainer's run to `max_steps` (`save_steps`: a checkpoint every so
    many; `resume`: from that checkpoint directory): the weights after each
    optimizer step it took, and the optimizer."""
    model = tiny(kind)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=max_steps, max_grad_norm=0.5, learning_rate=LR, warmup_steps=1,
        lr_scheduler_type="cosine", logging_strategy="no",
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        report_to=[], use_cpu=True, dataloader_num_workers=0, seed=0, data_seed=0,
        disable_tqdm=True)
    opt = make_optimizer(model)
    sched = transformers.get_cosine_schedule_with_warmup(opt, 1, STEPS)
    watch = WeightsAfterEachStep(model)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   optimizers=(opt, sched), callbacks=[watch])
    trainer.train(resume_from_checkpoint=resume)
    return watch.weights, opt


def torch_adamw(model, fused=False):
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                             fused=fused)


def largest_difference(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
@pytest.mark.parametrize("kind", ["llama", "gpt2", "mixtral"])
def test_trainer_with_fuyou_adamw_matches_torch_step_by_step(daemon, kind, streamed, tmp_path):
    ref, _ = train(kind, torch_adamw, tmp_path / "torch")
    made = []

    def fuyou_adamw(model):
        opt = fuyou.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                          address=daemon.address, job=f"hf-{kind}-{os.getpid()}-{next(_jobs)}",
                          chunk_bytes=8 << 10, offload_params=streamed)
        made.append(opt)
        if streamed:  # the weights live in fuyoud; each module's come in for its forward
            made.append(fuyou.stream_parameters(model, opt, device_budget="64KiB"))
        return opt

    try:
        got, opt = train(kind, fuyou_adamw, tmp_path / "fuyou")
        spread = [0.0] * STEPS  # torch's fused against its foreach: the rounding's reach
        if kind == "mixtral":
            fused, _ = train(kind, lambda m: torch_adamw(m, fused=True), tmp_path / "fused")
            spread = [largest_difference(a, b) for a, b in zip(fused, ref)]
        assert len(got) == len(ref) == STEPS
        for step, (a, b) in enumerate(zip(got, ref)):
            if largest_difference(a, b) <= 2 * spread[step]:
                continue
            for i, (x, y) in enumerate(zip(a, b)):
                bad = (x - y).abs() > ATOL + RTOL * y.abs()
                assert not bool(bad.any()), (
                    f"{kind} step {step}: parameter {i} differs by {float((x - y).abs().max())}"
                    f" (torch fused vs foreach: {spread[step]})")
        assert opt.committed_step == STEPS
        assert opt.loop_stats.speculative_updates > 0  # updates overlapped backward
    finally:
        for o in reversed(made):  # the stream's handle, then its optimizer
            o.close()


# ---------------------------------------------------------------- checkpoint and resume
def _phase(kind, which, streamed, out_dir, max_steps, resume, address, job, result):
    """One Trainer run in this process (``python test_hf_trainer.py ...``): the
    weights after each step it took go to `result` (torch.save)."""
    made = []

    def make(model):
        if which == "torch":
            return torch_adamw(model)
        opt = fuyou.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                          address=address, job=job, chunk_bytes=8 << 10,
                          offload_params=streamed)
        made.append(opt)
        if streamed:
            made.append(fuyou.stream_parameters(model, opt, device_budget="64KiB"))
        return opt

    try:
        weights, _ = train(kind, make, out_dir, max_steps=max_steps, save_steps=2,
                           resume=resume or None)
        torch.save(weights, result)
    finally:
        for o in reversed(made):
            o.close()


def _run_phase(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[2] / "python_client"), str(Path(__file__).parent)]))
    done = subprocess.run([sys.executable, __file__, *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
def test_trainer_checkpoint_resumes_in_a_new_process_like_torch(daemon, streamed, tmp_path):
    """save_steps=2, a first process stops at step 2; a new one resumes from
    checkpoint-2 (the model's safetensors, fuyou's optimizer.pt, the
    scheduler) to step 4: every step as the same two runs with torch's AdamW."""
    job = f"hf-resume-{os.getpid()}-{next(_jobs)}"
    for which in ("torch", "fuyou"):
        out = tmp_path / which
        _run_phase("llama", which, int(streamed), out, 2, "", daemon.address, job,
                   tmp_path / f"{which}-first.pt")
        _run_phase("llama", which, int(streamed), out, 4, out / "checkpoint-2", daemon.address,
                   job, tmp_path / f"{which}-resumed.pt")
    for phase in ("first", "resumed"):
        got = torch.load(tmp_path / f"fuyou-{phase}.pt")
        ref = torch.load(tmp_path / f"torch-{phase}.pt")
        assert len(got) == len(ref) == 2, phase
        for step, (a, b) in enumerate(zip(got, ref)):
            for i, (x, y) in enumerate(zip(a, b)):
                assert bool(((x - y).abs() <= ATOL + RTOL * y.abs()).all()), (
                    f"{phase} step {step}: parameter {i} differs by {float((x - y).abs().max())}")


if __name__ == "__main__":
    kind, which, streamed, out_dir, max_steps, resume, address, job, result = sys.argv[1:]
    _phase(kind, which, bool(int(streamed)), out_dir, int(max_steps), resume, address, job,
           result)
