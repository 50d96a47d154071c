"""Exactness, second round (issue 31): habits an experienced torch user has,
against torch.optim.AdamW on the same model and batches, weights compared
after every step (``|a - b| <= 1e-6 + 1e-5 |b|``).

- streamed: hyper-parameters edited between backward() and step() (a
  scheduler stepped first, lr/betas/eps/weight_decay set by hand) are redone
  from the daemon's gradient journal in this step, not the next;
- streamed: ``p.grad = None`` after backward() skips the parameter, as torch
  does (whole parameters, one of a chunk's several, with clipping);
- resident: a parameter frozen when the optimizer was built and unfrozen later
  is updated from its first gradient on, with fresh moments;
- resident: weights edited outside step() (``p.data.clamp_``, a ``no_grad``
  rescale, ``reset_parameters()``, ``model.load_state_dict``) are taken into the
  masters before the next update;
- streamed: what it cannot see or do is refused at step(), naming the parameter.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fuyou
from test_stream_loops import _loss, loop_backend, run_side_by_side  # noqa: F401
from test_stream_parameters import (BETAS, EPS, LR, WD, TwiceNet, offload_adamw,  # noqa: F401
                                    stream_backend, torch_adamw, twice_batch)

ATOL, RTOL = 1e-6, 1e-5


# ---------------------------------------------------------------- streamed: late edits
@pytest.mark.parametrize("edit", ["lr", "betas", "eps", "weight_decay", "scheduler_first"])
def test_streamed_hyper_parameters_set_between_backward_and_step(loop_backend, edit):
    schedulers = {}  # per optimizer: stepped before optimizer.step(), a common slip

    def body(m, o, step):
        _loss(m, step).backward()
        g = o.param_groups[0]
        if edit == "lr":
            g["lr"] = LR * (1.0 + step)
        elif edit == "betas":
            g["betas"] = (0.8 + 0.02 * step, 0.99)
        elif edit == "eps":
            g["eps"] = 1e-3 * (step + 1)
        elif edit == "weight_decay":
            g["weight_decay"] = 0.05 * (step + 1)
        else:
            schedulers.setdefault(id(o), torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5)).step()
        return True

    opt, _model = run_side_by_side(loop_backend, 4, body, what=edit)
    assert opt.loop_stats.redone_changed > 0, "no chunk was redone for the new hyper-parameters"


@pytest.mark.parametrize("which", ["one", "all_of_a_module", "tied_head", "with_clip"])
def test_streamed_grad_set_to_none_after_backward_skips_the_parameter(loop_backend, which):
    def names_to_drop(m, step):
        named = dict(m.named_parameters())
        if which == "one" or which == "with_clip":
            return ["gated.bias"] if step % 2 == 0 else ["shared.weight"]
        if which == "all_of_a_module":
            return [n for n in named if n.startswith("shared.")]
        return ["emb.weight"]  # the embedding tied to the head

    def body(m, o, step):
        _loss(m, step).backward()
        named = dict(m.named_parameters())
        for n in names_to_drop(m, step):
            named[n].grad = None
        if which == "with_clip":
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
        return True

    run_side_by_side(loop_backend, 4, body, what=f"grad None ({which})",
                     zero=lambda o: o.zero_grad(set_to_none=True))


def test_twice_net_has_the_parameters_these_tests_drop():
    names = dict(TwiceNet().named_parameters())
    for n in ("gated.bias", "shared.weight", "emb.weight"):
        assert n in names, sorted(names)
