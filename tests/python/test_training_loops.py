"""fuyou.AdamW against torch.optim.AdamW in the training loops people write
(issue 10: speculate, validate, redo).

Every test trains the same small model twice, from the same initial weights on
the same data: once with fuyou.AdamW on a real fuyoud, with the default
``overlap=True`` and without ``accumulation_steps``, and once with
torch.optim.AdamW. After EVERY step (or skipped step) each weight must satisfy
``|a - b| <= ATOL + RTOL * |b|`` with b the torch weight (the issue's
``1e-6 + 1e-5|a|``); the bf16 test states its own bound.

Overlap must stay on: ``opt.loop_stats`` (LoopStats: steps, speculative_updates,
redone_changed, redone_clipped, steps_with_redo, rolled_back_skipped,
redo_seconds; cumulative since the optimizer was opened) is read after every
iteration, and each test checks what each iteration did: at least one chunk was
updated speculatively during backward in every step, chunks were redone in the
steps whose gradients changed after they were sent (and in no other), skipped
steps were rolled back. The weights are checked first, so a test that fails on
wrong weights says so before it says anything about the statistics.

The model (LoopNet, fp32, one parameter group, CHUNK_BYTES = 6 KiB) packs into 5
chunks, in backward order:
    0: head.bias, head.weight, extra.bias
    1: extra.weight, ln2.bias, ln2.weight, fc2.bias
    2: fc2.weight, ln1.bias, ln1.weight, fc1.bias
    3: fc1.weight
    4: emb.weight
With 2 slots, chunks are sent and their new weights staged during backward.
`extra` (a Linear used only on even steps in test_parameter_without_gradient...)
shares chunks 0 and 1 with parameters that always have gradients.
"""

from __future__ import annotations

import copy
import itertools
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuyou

RTOL = 1e-5
ATOL = 1e-6
STEPS = 6
LR = 3e-3
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
CHUNK_BYTES = 6 << 10
NUM_CHUNKS = 5
NUM_SLOTS = 2
VOCAB, DIM, SEQ, BATCH = 48, 24, 8, 8
TINY_NORM = 1e-3  # clip_grad_norm_ with it scales the gradients in every step
HUGE_NORM = 1e6  # never does (the gradients are multiplied by exactly 1.0)

STATS_FIELDS = ("steps", "speculative_updates", "redone_changed", "redone_clipped",
                "steps_with_redo", "rolled_back_skipped", "redo_seconds")
_jobs = itertools.count()


# ----------------------------------------------------------------------- model
class LoopNet(nn.Module):
    """Embedding -> Linear/LayerNorm/GELU/Linear residual block -> an optional
    residual Linear (`extra`) -> LayerNorm -> Linear head; cross-entropy loss
    computed in fp32."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.ln1 = nn.LayerNorm(2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)
        self.ln2 = nn.LayerNorm(DIM)
        self.extra = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx, targets, use_extra=True):
        x = self.emb(idx)
        x = x + self.fc2(F.gelu(self.ln1(self.fc1(x))))
        if use_extra:
            x = x + self.extra(x)
        logits = self.head(self.ln2(x))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def make_pair(dtype=torch.float32, seed=0):
    """Two models with the same initial weights (initialized in fp32, then cast)."""
    torch.manual_seed(seed)
    a = LoopNet().to(dtype)
    return a, copy.deepcopy(a)


def loss_of(model, step, micro=0, use_extra=True):
    """The loss of a batch that is a function of (step, micro) only."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return model(data[:, :-1], data[:, 1:], use_extra=use_extra)


def torch_adamw(params):
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)


@pytest.fixture
def fuyou_adamw(daemon):
    """fuyou_adamw(params, job=None, **kw): fuyou.AdamW as a user builds it, on the
    module's fuyoud: overlap left at its default (on), no accumulation_steps.
    Every optimizer made is closed at the end of the test, failed or not."""
    made = []

    def make(params, job=None, **kw):
        assert "overlap" not in kw and "accumulation_steps" not in kw
        params = list(params)
        # The same layout in every dtype: CHUNK_BYTES holds as many elements as in fp32.
        chunk_bytes = CHUNK_BYTES // 4 * params[0].element_size()
        opt = fuyou.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                          job=job or f"loops-{os.getpid()}-{next(_jobs)}",
                          address=daemon.address, chunk_bytes=chunk_bytes,
                          num_slots=NUM_SLOTS, timeout=20.0, **kw)
        made.append(opt)
        assert opt.num_chunks == NUM_CHUNKS, "the chunk layout the tests rely on changed"
        return opt

    yield make
    for opt in made:
        opt.close()


# ----------------------------------------------------------------- comparisons
def max_abs_error(model, ref) -> float:
    """Largest |a - b| over all weights (nan when any weight is nan)."""
    return torch.stack([(a.detach().double() - b.detach().double()).abs().max()
                        for a, b in zip(model.parameters(), ref.parameters())]).max().item()


def assert_matches(model, ref, step, what):
    """Every weight of `model` within ATOL + RTOL * |w| of `ref`'s (torch's)."""
    for (name, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        a, b = a.detach().double(), b.detach().double()
        err = (a - b).abs()
        if not bool((err <= ATOL + RTOL * b.abs()).all()):
            pytest.fail(
                f"{what}: after step {step}, {name} differs from torch.optim.AdamW by up to "
                f"{err.max().item():.3g} (allowed {ATOL:g} + {RTOL:g}*|w|); largest error "
                f"over the model {max_abs_error(model, ref):.3g}", pytrace=False)


class StatsLog:
    """opt.loop_stats read after every iteration; `check` tests what each did."""

    def __init__(self, opt):
        self.opt = opt
        self.snaps = [self._read()]
        self.expectations = []

    def _read(self):
        s = getattr(self.opt, "loop_stats", None)
        return None if s is None else {f: getattr(s, f, None) for f in STATS_FIELDS}

    def after(self, step, stepped=True, redo=None):
        """Records iteration `step`: `stepped` whether the loop called step();
        `redo` True (some chunk must be redone), False (none may be), None (not
        checked)."""
        self.snaps.append(self._read())
        self.expectations.append((step, stepped, redo))

    def check(self, what):
        if any(s is None for s in self.snaps):
            pytest.fail(f"{what}: the weights matched, but fuyou.AdamW has no loop_stats "
                        "(issue 10): cannot tell whether overlap stayed on", pytrace=False)
        missing = [f for f in STATS_FIELDS if self.snaps[0][f] is None]
        assert not missing, f"{what}: loop_stats lacks {missing}"
        for (step, stepped, redo), a, b in zip(self.expectations, self.snaps, self.snaps[1:]):
            d = {f: b[f] - a[f] for f in STATS_FIELDS}
            where = f"{what}, step {step}: loop_stats went from {a} to {b}"
            assert d["steps"] == int(stepped), where
            if stepped:
                assert d["speculative_updates"] > 0, f"overlap was off: {where}"
            redone = d["redone_changed"] + d["redone_clipped"]
            if redo is True:
                assert redone > 0 and d["steps_with_redo"] == 1, f"no redo: {where}"
            elif redo is False:
                assert redone == 0 and d["steps_with_redo"] == 0, f"needless redo: {where}"
        return {f: self.snaps[-1][f] - self.snaps[0][f] for f in STATS_FIELDS}


def clip(model, max_norm):
    """torch.nn.utils.clip_grad_norm_; True when it scaled the gradients."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return bool(max_norm / (float(norm) + 1e-6) < 1.0)


# ------------------------------------------------------------------ the loops
@pytest.mark.parametrize("max_norm", [TINY_NORM, HUGE_NORM], ids=["clips-every-step",
                                                                  "never-clips"])
def test_external_clip_grad_norm(fuyou_adamw, max_norm):
    """loss.backward(); clip_grad_norm_(params, max_norm); opt.step() (HF Trainer,
    accelerate, Lightning, nanoGPT)."""
    model, ref = make_pair()
    ref_opt, opt = torch_adamw(ref.parameters()), fuyou_adamw(model.parameters())
    log = StatsLog(opt)
    for step in range(STEPS):
        loss_of(ref, step).backward()
        clipped = clip(ref, max_norm)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

        loss_of(model, step).backward()
        clip(model, max_norm)
        opt.step()
        opt.zero_grad()
        assert clipped == (max_norm == TINY_NORM)
        assert_matches(model, ref, step, f"external clip_grad_norm_({max_norm:g})")
        log.after(step, redo=clipped)
    total = log.check(f"external clip_grad_norm_({max_norm:g})")
    assert total["rolled_back_skipped"] == 0
    if max_norm == TINY_NORM:
        assert total["redo_seconds"] > 0
    else:
        assert total["redo_seconds"] == 0
    assert opt.committed_step == STEPS
    opt.close()


@pytest.mark.parametrize("max_norm", [TINY_NORM, HUGE_NORM], ids=["clips-every-step",
                                                                  "never-clips"])
def test_max_grad_norm_with_overlap(fuyou_adamw, max_norm):
    """fuyou.AdamW(max_grad_norm=) against clip_grad_norm_ then torch AdamW;
    overlap stays on: chunks are updated during backward and redone with the
    clip coefficient at step() when it is < 1."""
    model, ref = make_pair()
    ref_opt = torch_adamw(ref.parameters())
    opt = fuyou_adamw(model.parameters(), max_grad_norm=max_norm)
    log = StatsLog(opt)
    for step in range(STEPS):
        loss_of(ref, step).backward()
        clipped = clip(ref, max_norm)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()
        assert clipped == (max_norm == TINY_NORM)
        assert_matches(model, ref, step, f"max_grad_norm={max_norm:g}")
        log.after(step, redo=clipped)
    total = log.check(f"max_grad_norm={max_norm:g}")
    if max_norm == TINY_NORM:
        assert total["redone_clipped"] > 0 and total["redone_changed"] == 0, total
    opt.close()


def test_four_backward_passes_per_step_with_external_clip(fuyou_adamw):
    """Gradient accumulation the loop does not announce: 4 x (loss / 4).backward(),
    clip_grad_norm_, step. fuyou learns it at the second backward of the first step."""
    k = 4
    model, ref = make_pair()
    ref_opt, opt = torch_adamw(ref.parameters()), fuyou_adamw(model.parameters())
    log = StatsLog(opt)
    for step in range(STEPS):
        for i in range(k):
            (loss_of(ref, step, micro=i) / k).backward()
        clipped = clip(ref, TINY_NORM)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

        for i in range(k):
            (loss_of(model, step, micro=i) / k).backward()
        clip(model, TINY_NORM)
        opt.step()
        opt.zero_grad()
        assert clipped
        assert_matches(model, ref, step, "4 backward passes per step + clip_grad_norm_")
        log.after(step, redo=True)
    log.check("4 backward passes per step + clip_grad_norm_")
    opt.close()


def test_in_place_unscaling_of_a_scaled_loss(fuyou_adamw):
    """(loss * 1024).backward(); p.grad.div_(1024) for every p; step()."""
    scale = 1024.0
    model, ref = make_pair()
    ref_opt, opt = torch_adamw(ref.parameters()), fuyou_adamw(model.parameters())
    log = StatsLog(opt)
    for step in range(STEPS):
        for m, o in ((ref, ref_opt), (model, opt)):
            (loss_of(m, step) * scale).backward()
            for p in m.parameters():
                p.grad.div_(scale)
            o.step()
            o.zero_grad(set_to_none=True)
        assert_matches(model, ref, step, "in-place unscaling")
        log.after(step, redo=True)
    total = log.check("in-place unscaling")
    assert total["redone_changed"] > 0
    opt.close()


class HandScaler:
    """torch.cuda.amp.GradScaler's call sequence written out for CPU tensors:
    scale the loss, unscale the gradients in place (multiply by the fp32 inverse
    scale) and look for inf/nan, step only without them, then update the scale."""

    def __init__(self, init_scale=2.0 ** 10, growth_interval=2):
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.tracker = 0

    def unscale_(self, params) -> bool:
        inv = torch.tensor(self.scale, dtype=torch.float64).reciprocal().float()
        found_inf = False
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv)
                found_inf |= not bool(torch.isfinite(p.grad).all())
        return found_inf

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= 0.5
            self.tracker = 0
        else:
            self.tracker += 1
            if self.tracker == self.growth_interval:
                self.scale *= 2.0
                self.tracker = 0


def test_grad_scaler_sequence_with_an_inf_step(fuyou_adamw):
    """scaler.scale(loss).backward(); scaler.unscale_(opt); scaler.step(opt)
    (skipped when a gradient is inf); scaler.update(); opt.zero_grad(). An inf is
    injected into fc1.weight's gradient (chunk 3, late in backward: the chunks
    before it were already updated speculatively) in step INF_AT."""
    steps, inf_at = 7, 3
    model, ref = make_pair()
    ref_opt, opt = torch_adamw(ref.parameters()), fuyou_adamw(model.parameters())
    scalers = {id(ref): HandScaler(), id(model): HandScaler()}
    log = StatsLog(opt)
    for step in range(steps):
        skipped = {}
        for m, o in ((ref, ref_opt), (model, opt)):
            scaler = scalers[id(m)]
            handle = None
            if step == inf_at:
                handle = m.fc1.weight.register_hook(lambda g: torch.full_like(g, math.inf))
            (loss_of(m, step) * scaler.scale).backward()
            if handle is not None:
                handle.remove()
            found_inf = scaler.unscale_(m.parameters())
            if not found_inf:
                o.step()
            scaler.update(found_inf)
            o.zero_grad(set_to_none=True)
            skipped[id(m)] = found_inf
        assert skipped[id(ref)] == skipped[id(model)] == (step == inf_at)
        assert_matches(model, ref, step, "GradScaler sequence")
        log.after(step, stepped=step != inf_at, redo=None if step == inf_at else True)
    total = log.check("GradScaler sequence")
    assert total["rolled_back_skipped"] > 0, total
    assert opt.committed_step == steps - 1
    opt.close()


def test_a_skipped_step_every_third_step(fuyou_adamw):
    """Every third iteration: backward, no step(), zero_grad(), next iteration. The
    daemon's speculative updates of that iteration are rolled back."""
    steps = 8  # skips 2 and 5; the last iteration steps
    model, ref = make_pair()
    ref_opt, opt = torch_adamw(ref.parameters()), fuyou_adamw(model.parameters())
    log = StatsLog(opt)
    taken = 0
    for step in range(steps):
        skip = step % 3 == 2
        for m, o in ((ref, ref_opt), (model, opt)):
            loss_of(m, step).backward()
            if not skip:
                o.step()
            o.zero_grad(set_to_none=True)
        taken += not skip
        assert opt.committed_step == taken
        assert_matches(model, ref, step, "a skipped step every third step")
        log.after(step, stepped=not skip, redo=None if skip else False)
    total = log.check("a skipped step every third step")
    assert total["rolled_back_skipped"] >= 2, total
    opt.close()


def test_parameter_without_gradient_on_odd_steps_shares_a_chunk(fuyou_adamw):
    """`extra` is used on even steps only; zero_grad(set_to_none=True) leaves its
    .grad None on odd steps. torch keeps its weights, moments and per-parameter
    step then; `extra` shares chunks 0 and 1 with parameters that have gradients."""
    model, ref = make_pair()
    ref_opt, opt = torch_adamw(ref.parameters()), fuyou_adamw(model.parameters())
    log = StatsLog(opt)
    for step in range(STEPS + 1):  # ends on an even step: `extra` is updated again
        use_extra = step % 2 == 0
        for m, o in ((ref, ref_opt), (model, opt)):
            loss_of(m, step, use_extra=use_extra).backward()
            assert (m.extra.weight.grad is None) != use_extra
            o.step()
            o.zero_grad(set_to_none=True)
        assert_matches(model, ref, step, "a parameter without gradient on odd steps")
        log.after(step)
    log.check("a parameter without gradient on odd steps")

    # The moments and Adam's t of every parameter, as torch has them.
    exported = opt.export_checkpoint()["optimizer"]["state"]
    names = [n for n, _ in ref.named_parameters()]
    for i, p in enumerate(ref.parameters()):
        want = ref_opt.state[p]
        got = exported.get(i)
        assert got is not None, f"{names[i]}: no optimizer state exported"
        assert float(got["step"]) == float(want["step"]), (
            f"{names[i]}: exported step {float(got['step'])}, torch {float(want['step'])}")
        # Absolute floors at the moments' scale (gradients ~1e-2 per element;
        # measured with every parameter used: 6e-9 and 4e-10 at most).
        for key, atol in (("exp_avg", 1e-7), ("exp_avg_sq", 1e-9)):
            torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=atol,
                                       msg=lambda m: f"{names[i]} {key}: {m}")
    opt.close()


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers (8 significant bits) around |x|."""
    exponent = torch.frexp(x.double().abs().clamp_min(2.0 ** -126)).exponent
    return torch.pow(2.0, (exponent - 8).double())


def test_bf16_parameters_with_external_clip(fuyou_adamw):
    """bf16 parameters, external clip_grad_norm_ in every step. The reference is
    torch.optim.AdamW on fp32 master copies: a bf16 twin of the model computes
    forward and backward (the same bf16 arithmetic as fuyou's model), its bf16
    gradients (clipped in place, as in the fuyou loop) are the masters'
    gradients, and after each step the twin's weights are the masters rounded to
    bf16. Bounds after every step:
      - fuyou's fp32 masters (export_checkpoint) against the reference masters:
        ATOL + RTOL * |master|, as in fp32;
      - the bf16 weights against the reference masters rounded to bf16: at most
        one bf16 ulp (the masters agree to 1e-5 relative but may straddle a
        rounding boundary), and equal for at least 99% of the elements."""
    model, twin = make_pair(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_(True) for p in twin.parameters()]
    ref_opt = torch_adamw(masters)
    opt = fuyou_adamw(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    log = StatsLog(opt)
    for step in range(STEPS):
        loss_of(twin, step).backward()
        clipped = clip(twin, TINY_NORM)
        for master, p in zip(masters, twin.parameters()):
            master.grad = p.grad.float()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)
        with torch.no_grad():
            for master, p in zip(masters, twin.parameters()):
                p.copy_(master)

        loss_of(model, step).backward()
        clip(model, TINY_NORM)
        opt.step()
        opt.zero_grad()
        assert clipped

        exported = opt.export_checkpoint()["model"]
        for i, (name, master) in enumerate(zip(names, masters)):
            got = exported[i].double()
            err = (got - master.detach().double()).abs()
            if not bool((err <= ATOL + RTOL * master.detach().double().abs()).all()):
                pytest.fail(f"bf16 + external clip: after step {step}, the fp32 master of "
                            f"{name} differs from torch.optim.AdamW's by up to "
                            f"{err.max().item():.3g}", pytrace=False)
        differing = total = 0
        for name, a, b in zip(names, model.parameters(), twin.parameters()):
            assert a.dtype == torch.bfloat16
            err = (a.detach().double() - b.detach().double()).abs()
            assert bool((err <= _bf16_ulp(b.detach())).all()), (
                f"bf16 + external clip: after step {step}, {name} is more than one bf16 ulp "
                f"from the reference (up to {err.max().item():.3g})")
            differing += int((err > 0).sum())
            total += err.numel()
        assert differing <= 0.01 * total, f"step {step}: {differing} of {total} bf16 weights differ"
        log.after(step, redo=True)
    log.check("bf16 + external clip")
    opt.close()


def hf_linear_warmup(warmup, total):
    """transformers.get_linear_schedule_with_warmup's lr_lambda."""
    def lr_lambda(step):
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))
    return lr_lambda


def test_hf_trainer_shaped_loop_and_resume(fuyou_adamw):
    """transformers.Trainer's inner loop written out, with
    gradient_accumulation_steps=2 and max_grad_norm=1.0, in its order: k x
    (loss / k).backward(); clip_grad_norm_(model.parameters(), 1.0);
    optimizer.step(); lr_scheduler.step(); model.zero_grad(). The job is closed
    after step RESUME_AT - 1 and opened again (state_dict and scheduler state
    loaded as a resumed Trainer does); training continues and still matches."""
    k, max_norm, steps, resume_at = 2, 1.0, 8, 3
    # A weighted loss puts the gradient norm around max_norm: steps 0, 1, 4, 5 clip,
    # steps 2, 3, 6, 7 do not (norms 1.05 ... 0.97, at least 3e-3 from 1.0).
    loss_weight = 1.7
    lr_lambda = hf_linear_warmup(2, steps + 2)
    model, ref = make_pair()
    ref_opt, opt = torch_adamw(ref.parameters()), fuyou_adamw(model.parameters())
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lr_lambda)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    job = opt.job
    logs = [StatsLog(opt)]
    clipped_steps = 0
    for step in range(steps):
        if step == resume_at:
            opt_state, sched_state = opt.state_dict(), sched.state_dict()
            opt.close()
            opt = fuyou_adamw(model.parameters(), job=job)
            assert opt.resumed and opt.committed_step == resume_at
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
            opt.load_state_dict(opt_state)
            sched.load_state_dict(sched_state)
            logs.append(StatsLog(opt))
        first_of_session = step in (0, resume_at)
        clipped = None
        for m, o, s in ((ref, ref_opt, ref_sched), (model, opt, sched)):
            for i in range(k):
                (loss_weight * loss_of(m, step, micro=i) / k).backward()
            c = clip(m, max_norm)
            clipped = c if clipped is None else clipped
            assert c == clipped
            o.step()
            s.step()
            m.zero_grad()
        assert opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])
        clipped_steps += clipped
        assert_matches(model, ref, step, "HF-Trainer-shaped loop")
        # The first step of a session learns the accumulation (a redo); later
        # steps are sent after the k-th pass and redone only when clipped.
        logs[-1].after(step, redo=True if clipped else (None if first_of_session else False))
    assert 2 <= clipped_steps <= steps - 2, "the test should clip in some steps, not all"
    for log in logs:
        log.check("HF-Trainer-shaped loop")
    opt.close()


def test_gpu_check_script_skips_without_gpu_or_transformers():
    """tests/gpu/check_loops_gpu.py compiles and, on a machine without CUDA or
    transformers, exits 0 saying it skipped."""
    import importlib.util
    import py_compile
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "gpu" / "check_loops_gpu.py"
    py_compile.compile(str(script), doraise=True)
    if torch.cuda.is_available() and importlib.util.find_spec("transformers") is not None:
        pytest.skip("CUDA and transformers present: run tests/gpu/check_loops_gpu.py itself")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "skipped: no GPU" in out.stdout or "skipped: no transformers" in out.stdout, (
        out.stdout + out.stderr)
