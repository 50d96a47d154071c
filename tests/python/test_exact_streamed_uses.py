"""A streamed parameter used outside the forward of the modules that hold it
(issue 31, item 5), and edited in place outside step() (item 2), against
torch.optim.AdamW on the same model and batches, weights compared after every
step (``|a - b| <= 1e-6 + 1e-5 |b|``).

- followed (exact): GPT-2's head ``F.linear(h, wte.weight)`` in the model's own
  forward, a weight read by a module that does not hold it, an L2 penalty over
  every parameter after the forward and one inside it, a norm logged under
  ``no_grad``, an EMA read through ``p.detach()``;
- taken into the masters between steps (exact): ``no_grad`` ``mul_``,
  ``p.data.clamp_`` (WGAN), ``nn.init`` / ``reset_parameters()``, ``p.copy_``,
  ``p.data = t``;
- refused clearly, naming the parameter and its modules: an edit between
  backward() and step(), an operation on ``p.double()`` (a tensor without
  values), a use once the optimizer is closed. No use adds 0 silently.
"""

from __future__ import annotations

import copy
import itertools
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fuyou
from test_stream_parameters import (assert_matches_daemon, offload_adamw,  # noqa: F401
                                    stream_backend, torch_adamw, twice_batch)
from test_stream_state_dict import real  # noqa: F401  (the edits import masters: a real fuyoud)
from test_training_loops import assert_matches, fuyou_adamw, loss_of, make_pair  # noqa: F401
from test_training_loops import torch_adamw as resident_torch_adamw

_jobs = (f"uses-{os.getpid()}-{i}" for i in itertools.count())
VOCAB, D = 32, 24


class FunctionalHead(nn.Module):
    """GPT-2's habit: the head is ``F.linear(h, self.wte.weight)`` (or
    ``h @ self.wte.weight.T``) in the model's own forward (no head module);
    ``other`` reads ``blocks[0].weight`` in its forward, a module that does not
    hold it."""

    def __init__(self, head="F.linear"):
        super().__init__()
        self.head = head
        self.wte = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.other = Reader(self.blocks)
        self.ln = nn.LayerNorm(D)

    def forward(self, idx, targets):
        x = self.wte(idx)
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        x = self.other(x)
        h = self.ln(x)
        logits = F.linear(h, self.wte.weight) if self.head == "F.linear" else h @ self.wte.weight.T
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class Reader(nn.Module):
    """Holds a weight of its own and reads one of a module it does not hold."""

    def __init__(self, blocks):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(D))
        self._blocks = [blocks]  # not a submodule: its parameters are not this module's

    def forward(self, x):
        return x * self.scale + 0.1 * F.linear(x, self._blocks[0][0].weight)


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.fc = nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx, targets, penalty_inside=False):
        x = self.head(torch.tanh(self.fc(self.wte(idx))))
        loss = F.cross_entropy(x.reshape(-1, VOCAB), targets.reshape(-1))
        if penalty_inside:  # a penalty the model computes itself
            loss = loss + 1e-2 * self.fc.weight.pow(2).sum() + 1e-2 * self.wte.weight.norm()
        return loss


def _l2(model):
    return sum(p.pow(2).sum() for p in model.parameters())


def _side_by_side(backend, make, steps, body, what, after=lambda model, ref: None):
    """Trains `make()` with torch's AdamW and streamed fuyou.AdamW, one
    ``body(model, opt, step)`` per step (it returns the loss to backward),
    then step() and zero_grad(); compares after every step; then
    ``after(model, ref)`` with the stream still open."""
    torch.manual_seed(1)
    model = make()
    ref = copy.deepcopy(model)
    ref_opt = torch_adamw(ref.parameters())
    opt = offload_adamw(backend, model.parameters(), job=next(_jobs))
    handle = fuyou.stream_parameters(model, opt, device_budget="4KiB", prefetch=2)
    try:
        for step in range(steps):
            for m, o in ((ref, ref_opt), (model, opt)):
                body(m, o, step).backward()
                o.step()
                o.zero_grad()
            assert_matches_daemon(opt, ref, step, what)
        after(model, ref)
        return opt, model, ref
    finally:
        handle.close()
        opt.close()


# ---------------------------------------------------------------- followed uses
@pytest.mark.parametrize("head", ["F.linear", "matmul_T"])
def test_gpt2_head_and_a_weight_read_by_another_module_are_followed(stream_backend, head):
    _side_by_side(stream_backend, lambda: FunctionalHead(head), 3,
                  lambda m, o, step: m(*twice_batch(step)), head)


@pytest.mark.parametrize("where", ["after_forward", "inside_forward"])
def test_l2_penalty_over_the_parameters_is_followed(stream_backend, where):
    def body(m, o, step):
        if where == "after_forward":
            return m(*twice_batch(step)) + 1e-2 * _l2(m)
        return m(*twice_batch(step), penalty_inside=True)

    def after(model, ref):
        with torch.no_grad():  # never 0: the penalty reads the real weights
            assert float(_l2(model)) == pytest.approx(float(_l2(ref)), rel=1e-5)

    _side_by_side(stream_backend, Plain, 3, body, f"L2 penalty {where}", after)


def test_reads_under_no_grad_and_through_detach_are_the_weights(stream_backend):
    """A logged norm and an EMA of the weights read the daemon's weights, as
    torch's read the model's."""
    emas = {}

    def body(m, o, step):
        with torch.no_grad():
            ema = emas.setdefault(id(m), [torch.zeros_like(p) for p in _shapes(m)])
            for e, p in zip(ema, m.parameters()):
                e.lerp_(p.detach(), 0.5)
            emas[(id(m), "norm")] = [float(p.norm()) for p in m.parameters()]
        return m(*twice_batch(step))

    _opt, model, ref = _side_by_side(stream_backend, Plain, 3, body, "reads")
    for a, b in zip(emas[id(model)], emas[id(ref)]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert emas[(id(model), "norm")] == pytest.approx(emas[(id(ref), "norm")], rel=1e-5)


def _shapes(m):
    """Zeros shaped as `m`'s parameters (a streamed one's shape is its block's)."""
    sd = m.state_dict()
    return [sd[n] for n, _ in m.named_parameters()]


# ---------------------------------------------------------------- edits between steps
def _edit(m, step, how):
    torch.manual_seed(100 + step)
    if how == "no_grad_mul":
        with torch.no_grad():
            m.fc.weight.mul_(0.5)
    elif how == "data_clamp":  # WGAN's critic
        for p in m.parameters():
            p.data.clamp_(-0.05, 0.05)
    elif how == "reset_parameters":
        m.fc.reset_parameters()
    elif how == "copy_":
        with torch.no_grad():
            m.head.bias.copy_(torch.linspace(-1, 1, VOCAB))
    elif how == "data_assign":
        m.head.bias.data = torch.full((VOCAB,), 0.5)


@pytest.mark.parametrize("how", ["no_grad_mul", "data_clamp", "reset_parameters", "copy_",
                                 "data_assign"])
def test_weights_edited_between_steps_go_into_the_masters(real, how):
    def body(m, o, step):
        if step in (0, 2):  # before the first step, and between two
            _edit(m, step, how)
        return m(*twice_batch(step))

    opt, _, _ = _side_by_side(real, Plain, 4, body, how)
    assert opt.offload.placeholders.edits_taken > 0


@pytest.mark.parametrize("how", ["no_grad_mul", "data_clamp", "data_assign"])
def test_an_edit_between_backward_and_step_is_refused_naming_the_parameter(stream_backend, how):
    torch.manual_seed(1)
    model = Plain()
    opt = offload_adamw(stream_backend, model.parameters(), job=next(_jobs))
    handle = fuyou.stream_parameters(model, opt, device_budget="4KiB")
    try:
        model(*twice_batch(0)).backward()
        with pytest.raises(fuyou.FailedPrecondition,
                           match=r"parameter '(fc.weight|wte.weight|head.bias)'.*between "
                                 r"backward\(\) and step\(\)"):
            _edit(model, 0, how)
        opt.step()
        assert opt.committed_step == 1
    finally:
        handle.close()
        opt.close()


@pytest.mark.parametrize("when", ["before_the_first_backward", "between_it_and_the_first_step"])
def test_resident_edits_before_the_first_step_are_taken(fuyou_adamw, when):
    """The resident mode's watch starts when the optimizer is built: an edit
    before the first step() goes into the masters as a later one does."""
    model, ref = make_pair()
    ref_opt, opt = resident_torch_adamw(ref.parameters()), fuyou_adamw(model.parameters())

    def edit(m):
        with torch.no_grad():
            m.fc1.weight.mul_(0.5)
        for p in m.parameters():
            p.data.clamp_(-0.05, 0.05)

    for step in range(3):
        for m, o in ((ref, ref_opt), (model, opt)):
            if step == 0 and when == "before_the_first_backward":
                edit(m)
            loss_of(m, step).backward()
            if step == 0 and when == "between_it_and_the_first_step":
                edit(m)
            o.step()
            o.zero_grad(set_to_none=True)
        assert_matches(model, ref, step, when)


# ---------------------------------------------------------------- refused
def test_a_tensor_made_without_values_is_refused_not_summed_to_zero(stream_backend):
    torch.manual_seed(1)
    model = Plain()
    opt = offload_adamw(stream_backend, model.parameters(), job=next(_jobs))
    handle = fuyou.stream_parameters(model, opt, device_budget="4KiB")
    try:
        with pytest.raises(fuyou.FailedPrecondition,
                           match=r"parameter 'fc.weight' of job .*module 'fc'.*to\(\), float\(\)"):
            model.fc.weight.double().pow(2).sum()
        assert model.fc.weight.shape == (0,)  # metadata is the placeholder's, as before
    finally:
        handle.close()
        opt.close()
    with pytest.raises(fuyou.FailedPrecondition, match="optimizer is closed|no open"):
        _l2(model)


def test_the_messages_name_the_modules_of_a_tied_parameter(stream_backend):
    from test_stream_parameters import TwiceNet
    torch.manual_seed(1)
    model = TwiceNet()
    opt = offload_adamw(stream_backend, model.parameters(), job=next(_jobs))
    handle = fuyou.stream_parameters(model, opt, device_budget="4KiB")
    try:
        model(*twice_batch(0)).backward()
        with pytest.raises(fuyou.FailedPrecondition,
                           match=r"parameter 'emb.weight' .*module 'emb', also held by 'head'"):
            with torch.no_grad():
                model.head.weight.mul_(2)
        opt.step()
    finally:
        handle.close()
        opt.close()


def test_an_edit_of_the_fetched_weights_inside_a_forward_is_refused_once_at_step(real):
    torch.manual_seed(1)
    model = Plain()
    opt = offload_adamw(real, model.parameters(), job=next(_jobs))
    handle = fuyou.stream_parameters(model, opt, device_budget="4KiB")
    edited_in = []

    def hook(module, args):
        with torch.no_grad():
            module.weight.mul_(0.5)  # in use: a view of the fetched block
        edited_in.append(module)

    try:
        model(*twice_batch(0)).backward()
        opt.step()
        opt.zero_grad()
        h = model.fc.register_forward_pre_hook(hook)
        model(*twice_batch(1)).backward()
        h.remove()
        assert edited_in == [model.fc]
        with pytest.raises(fuyou.FailedPrecondition,
                           match=r"fc.*changed in place outside step\(\) while its module held"):
            opt.step()
        opt.step()  # said once: the step goes on
        assert opt.committed_step == 2
    finally:
        handle.close()
        opt.close()


class DataEditInForward(nn.Linear):
    """Edits its own weights through ``.data`` in its forward (no version
    counter sees it) when ``shrink`` is set."""

    shrink = False

    def forward(self, x):
        if self.shrink:
            self.weight.data.mul_(0.5)
        return super().forward(x)


def test_a_data_edit_inside_a_modules_own_forward_is_refused_at_step(stream_backend):
    """``self.weight.data.mul_`` in the module's forward reaches only the
    fetched copy: step() refuses it naming the parameter, never loses it."""
    torch.manual_seed(1)
    model = Plain()
    model.fc.__class__ = DataEditInForward
    opt = offload_adamw(stream_backend, model.parameters(), job=next(_jobs))
    handle = fuyou.stream_parameters(model, opt, device_budget="4KiB")
    try:
        model(*twice_batch(0)).backward()
        opt.step()  # no edit: taken
        opt.zero_grad()
        model.fc.shrink = True
        model(*twice_batch(1)).backward()
        model.fc.shrink = False
        with pytest.raises(fuyou.FailedPrecondition,
                           match=r"'fc.weight'.*changed in place outside step\(\) while its module "
                                 r"held .*self.weight.data.mul_.*Change it between steps"):
            opt.step()
        assert opt.committed_step == 1
        opt.step()  # said once: the step goes on
        assert opt.committed_step == 2
    finally:
        handle.close()
        opt.close()
