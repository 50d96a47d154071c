"""torch 2's surfaces, each exact against torch.optim.AdamW of the installed torch
or refused (issue 30, item 3), in the resident and the streamed mode.

Each test trains the same model twice, with torch.optim.AdamW and with
fuyou.AdamW, through the same loop body (backward, what the loop does to .grad,
step and zero_grad), and compares every weight after every step:
``|a - b| <= 1e-6 + 1e-5 |b|``. The streamed mode compares the daemon's weights
(export_checkpoint); the resident mode the model's own.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuyou
from conftest import Backend
from fuyou._errors import InvalidArgument
from test_stream_parameters import (ATOL, BETAS, EPS, LR, RTOL, WD, TwiceNet,
                                    assert_matches_daemon, offload_adamw, torch_adamw,
                                    twice_batch)

MODES = ["resident", "streamed"]


@pytest.fixture
def real(daemon):
    """The module's real fuyoud (these tests need the daemon, not the fake)."""
    return Backend("daemon", daemon.address, daemon)


def _open(backend, mode, model, **kw):
    """fuyou.AdamW over `model` in `mode`, with test_stream_parameters' settings;
    returns (optimizer, stream handle or None)."""
    if mode == "streamed":
        opt = offload_adamw(backend, model.parameters(), **kw)
        return opt, fuyou.stream_parameters(model, opt, device_budget="4KiB", prefetch=2)
    kw.setdefault("chunk_bytes", 8 << 10)
    opt = backend.adamw(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                        num_slots=3, **kw)
    return opt, None


def _assert_close(opt, mode, model, ref, step, what):
    if mode == "streamed":
        assert_matches_daemon(opt, ref, step, what)
        return
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        err = (a.detach().double() - b.detach().double()).abs()
        if not bool((err <= ATOL + RTOL * b.detach().double().abs()).all()):
            pytest.fail(f"{what}: after step {step}, {name} differs from torch.optim.AdamW "
                        f"by up to {err.max().item():.3g}", pytrace=False)


def side_by_side(backend, mode, steps, body, *, model_fn=TwiceNet, opt_kw=None, wrap=None,
                 what=""):
    """Runs ``body(model, opt, step)`` on a torch.optim.AdamW copy and on the
    fuyou.AdamW model (``wrap`` applied to both, e.g. torch.compile), comparing
    after every step. Returns (fuyou optimizer, torch optimizer) after closing
    the former."""
    torch.manual_seed(1)
    model = model_fn()
    ref = copy.deepcopy(model)
    ref_opt = torch_adamw(ref.parameters())
    opt, handle = _open(backend, mode, model, **(opt_kw or {}))
    run, run_ref = (wrap(model), wrap(ref)) if wrap is not None else (model, ref)
    try:
        for step in range(steps):
            body(run_ref, ref_opt, step)
            body(run, opt, step)
            _assert_close(opt, mode, model, ref, step, f"{what} ({mode})")
        return opt, ref_opt
    finally:
        if handle is not None:
            handle.close()
        opt.close()


def _loss(m, step):
    return m(*twice_batch(step), step=step)


def _plain_step(m, o, step):
    """backward, step, zero_grad: the loop every test builds on."""
    _loss(m, step).backward()
    o.step()
    o.zero_grad()


# ---------------------------------------------------------------- zero_grad
@pytest.mark.parametrize("mode", MODES)
def test_zero_grad_with_torch_2s_default_sets_none(real, mode):
    default = inspect.signature(torch.optim.Optimizer.zero_grad).parameters["set_to_none"].default
    assert default is True  # torch 2's
    nones = []

    def body(m, o, step):
        _loss(m, step).backward()
        o.step()
        o.zero_grad()
        nones.append(all(p.grad is None for p in o.param_groups[0]["params"]))

    side_by_side(real, mode, 4, body, what="zero_grad()")
    assert all(nones), nones


# ---------------------------------------------------------------- GradScaler
@pytest.mark.parametrize("mode", MODES)
def test_torch_amp_grad_scaler_on_the_cpu(real, mode):
    """The real torch.amp.GradScaler("cpu"): scaled loss, unscale_, clip, step
    (skipped at step 2: an inf gradient), update, growth after two good steps."""
    scalers, scales = {}, {}

    def body(m, o, step):
        scaler = scalers.setdefault(id(o), torch.amp.GradScaler("cpu", init_scale=2.0 ** 10,
                                                                growth_interval=2))
        loss = _loss(m, step)
        hook = None
        if step == 2:
            hook = loss.register_hook(lambda g: g * float("inf"))
        scaler.scale(loss).backward()
        if hook is not None:
            hook.remove()
        scaler.unscale_(o)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        scaler.step(o)
        scaler.update()
        o.zero_grad()
        scales.setdefault(id(o), []).append(scaler.get_scale())

    opt, ref_opt = side_by_side(real, mode, 5, body, what="GradScaler('cpu')")
    assert scales[id(opt)] == scales[id(ref_opt)], scales
    assert scales[id(opt)][2] == scales[id(opt)][1] / 2  # the inf halved the scale
    assert opt.committed_step == 4  # the skipped step was rolled back, not committed
    assert opt.loop_stats.rolled_back_skipped > 0


# ---------------------------------------------------------------- torch.compile
class SmallMLP(nn.Module):
    def __init__(self, vocab=32, d=24):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, targets, step=0):
        x = self.emb(idx)
        x = x + self.out(F.gelu(self.fc(x)))
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@pytest.mark.parametrize("mode", MODES)
def test_a_model_under_torch_compile(real, mode):
    torch._dynamo.reset()

    def body(m, o, step):
        m(*twice_batch(step)).backward()
        o.step()
        o.zero_grad()

    side_by_side(real, mode, 3, body, model_fn=SmallMLP, wrap=torch.compile,
                 what="torch.compile(model)")


# ---------------------------------------------------------------- checkpoint
class CheckpointedNet(nn.Module):
    def __init__(self, use_reentrant, vocab=32, d=24):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d),
                                                  nn.GELU(), nn.Linear(2 * d, d))
                                    for _ in range(2))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, targets, step=0):
        x = self.emb(idx)
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.use_reentrant)
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("mode", MODES)
def test_torch_utils_checkpoint(real, mode, use_reentrant):
    def body(m, o, step):
        m(*twice_batch(step)).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        o.step()
        o.zero_grad()

    side_by_side(real, mode, 3, body, model_fn=lambda: CheckpointedNet(use_reentrant),
                 what=f"checkpoint(use_reentrant={use_reentrant})")


# ---------------------------------------------------------------- optimizer hooks
@pytest.mark.parametrize("mode", MODES)
def test_step_pre_and_post_hooks_run_as_torchs(real, mode):
    calls = {}

    def body(m, o, step):
        if step == 0:
            o.register_step_pre_hook(
                lambda opt, args, kwargs: calls.setdefault(id(opt), []).append(("pre", len(args))))
            o.register_step_post_hook(
                lambda opt, args, kwargs: calls.setdefault(id(opt), []).append(("post", len(args))))
        _loss(m, step).backward()
        o.step()
        o.zero_grad()

    opt, ref_opt = side_by_side(real, mode, 3, body, what="step hooks")
    # args holds the optimizer itself, as torch's wrapper of step passes it
    assert calls[id(opt)] == calls[id(ref_opt)] == [("pre", 1), ("post", 1)] * 3


def test_a_step_pre_hook_that_sets_the_lr_is_used(real):
    """A pre-hook edits the lr between backward and the update (resident: the
    chunks sent during backward are redone with it)."""
    def body(m, o, step):
        if step == 0:
            def halve(opt, args, kwargs):
                for g in opt.param_groups:
                    g["lr"] = LR / (2 + opt_steps[id(opt)])
                opt_steps[id(opt)] += 1
            opt_steps[id(o)] = 0
            o.register_step_pre_hook(halve)
        _loss(m, step).backward()
        o.step()
        o.zero_grad()

    opt_steps = {}
    side_by_side(real, "resident", 3, body, what="step pre-hook sets lr")


def test_state_dict_hooks_run_as_torchs(real):
    """register_state_dict_pre/post_hook and register_load_state_dict_pre/post_hook:
    run in torch's order; a post hook's returned dict is what state_dict()
    returns; a load pre-hook's returned dict is what is loaded."""
    torch.manual_seed(1)
    model = TwiceNet()
    opt, _ = _open(real, "resident", model)
    try:
        for step in range(2):
            _loss(model, step).backward()
            opt.step()
            opt.zero_grad()
        seen = []
        opt.register_state_dict_pre_hook(lambda o: seen.append("pre"))

        def add_note(o, sd):
            seen.append("post")
            sd = dict(sd)
            sd["note"] = "kept"
            return sd

        opt.register_state_dict_post_hook(add_note)
        sd = opt.state_dict()
        assert seen == ["pre", "post"] and sd["note"] == "kept"

        # A load pre-hook that rewrites the lr: the rewritten dict is the one loaded.
        def rewrite(o, state_dict):
            seen.append("load-pre")
            state_dict = copy.deepcopy(state_dict)
            for g in state_dict["param_groups"]:
                g["lr"] = 1.25e-3
            return state_dict

        opt.register_load_state_dict_pre_hook(rewrite)
        opt.register_load_state_dict_post_hook(lambda o: seen.append("load-post"))
        opt.load_state_dict(sd)
        assert seen[2:] == ["load-pre", "load-post"], seen
        assert all(g["lr"] == 1.25e-3 for g in opt.param_groups)
    finally:
        opt.close()


# ---------------------------------------------------------------- the state dict
@pytest.mark.parametrize("mode", MODES)
def test_state_dict_has_torch_2s_keys_and_goes_both_ways(real, mode):
    """fuyou's state dict has exactly the group keys and the step type of the
    installed torch's AdamW; torch.optim.AdamW continues from it exactly, and
    fuyou.AdamW from torch's."""
    torch.manual_seed(1)
    model = TwiceNet()
    ref = copy.deepcopy(model)
    ref_opt = torch_adamw(ref.parameters())
    opt, handle = _open(real, mode, model)
    try:
        for step in range(2):
            _plain_step(ref, ref_opt, step)
            _plain_step(model, opt, step)
        ours, theirs = opt.state_dict(), ref_opt.state_dict()
        assert [set(g) for g in ours["param_groups"]] == [set(g) for g in theirs["param_groups"]]
        for index, state in theirs["state"].items():
            assert set(ours["state"][index]) == set(state), index
            assert type(ours["state"][index]["step"]) is type(state["step"])
            assert ours["state"][index]["step"].dtype == state["step"].dtype
        # fuyou -> torch: a fresh torch.optim.AdamW over a copy of the weights.
        if mode == "streamed":
            weights = opt.export_checkpoint()["model"]
            cont = copy.deepcopy(ref)
            with torch.no_grad():
                for p, w in zip(cont.parameters(), weights.values()):
                    p.copy_(w)
        else:
            cont = copy.deepcopy(model)
        cont_opt = torch_adamw(cont.parameters())
        cont_opt.load_state_dict(ours)
        for step in range(2, 4):
            _plain_step(ref, ref_opt, step)
            _plain_step(cont, cont_opt, step)
        for a, b in zip(cont.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    finally:
        if handle is not None:
            handle.close()
        opt.close()

    # torch -> fuyou: a new job from torch's state dict at step 4.
    model2 = copy.deepcopy(ref)
    opt2, handle2 = _open(real, mode, model2)
    try:
        opt2.load_state_dict(ref_opt.state_dict())
        for step in range(4, 6):
            _plain_step(ref, ref_opt, step)
            _plain_step(model2, opt2, step)
            _assert_close(opt2, mode, model2, ref, step, f"torch's state dict into fuyou ({mode})")
    finally:
        if handle2 is not None:
            handle2.close()
        opt2.close()


# ---------------------------------------------------------------- the constructor
@pytest.mark.parametrize("flags", [dict(foreach=True), dict(foreach=False), dict(fused=True),
                                   dict(fused=False), dict(capturable=True)],
                         ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_implementation_flags_are_accepted_and_change_nothing(real, flags):
    """foreach, fused and capturable choose torch's implementation of the same
    update: fuyou's daemon has one, so they are kept in the groups and ignored."""
    opt, _ = side_by_side(real, "resident", 2, _plain_step, opt_kw=flags, what=str(flags))
    for key, value in flags.items():
        assert opt.param_groups[0][key] == value


def test_a_tensor_lr_is_used_as_torchs(real):
    """torch 2 takes lr as a 0-dim tensor (for schedulers that fill_ it)."""
    def body(m, o, step):
        if step == 1:
            o.param_groups[0]["lr"].fill_(LR / 3)
        _loss(m, step).backward()
        o.step()
        o.zero_grad()

    torch.manual_seed(1)
    model = TwiceNet()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=torch.tensor(LR), betas=BETAS, eps=EPS,
                                weight_decay=WD)
    opt = real.adamw(model.parameters(), lr=torch.tensor(LR), betas=BETAS, eps=EPS,
                     weight_decay=WD, chunk_bytes=8 << 10)
    try:
        for step in range(3):
            body(ref, ref_opt, step)
            body(model, opt, step)
            _assert_close(opt, "resident", model, ref, step, "lr=torch.tensor(...)")
    finally:
        opt.close()


def test_differentiable_is_refused_by_name(real):
    model = TwiceNet()
    with pytest.raises(NotImplementedError, match="differentiable=True"):
        real.adamw(model.parameters(), differentiable=True)


def test_adams_coupled_weight_decay_is_refused_at_load(real):
    """torch.optim.Adam's state dict (decoupled_weight_decay=False: L2 in the
    gradient) with weight decay is not AdamW's update: refused, nothing loaded."""
    torch.manual_seed(1)
    model = TwiceNet()
    adam = torch.optim.Adam(model.parameters(), lr=LR, weight_decay=0.1)
    _loss(model, 0).backward()
    adam.step()
    opt, _ = _open(real, "resident", model)
    try:
        with pytest.raises((NotImplementedError, InvalidArgument), match="decoupled_weight_decay"):
            opt.load_state_dict(adam.state_dict())
        assert opt.param_groups[0]["lr"] == LR and opt.param_groups[0]["weight_decay"] == WD
    finally:
        opt.close()
