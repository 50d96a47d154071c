"""PassEnd (fuyou/_pass_end.py): once a backward pass, after every callback
queued during it (DDP's end-of-backward one), and grad_stamp."""

from __future__ import annotations

import torch

from fuyou._pass_end import PassEnd, grad_stamp

ENGINE = torch.autograd.Variable._execution_engine


class Recorder:
    def __init__(self):
        self.order = []

    def ended(self):
        self.order.append("end")


def test_runs_once_a_pass_after_the_callbacks_queued_later():
    rec = Recorder()
    end = PassEnd(rec, "ended")
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))

    def first(grad):  # every hook arms it; it runs once
        rec.order.append("hook")
        end.arm()

    def later(grad):  # as DDP queues its own once its last bucket is ready
        rec.order.append("hook")
        end.arm()
        ENGINE.queue_callback(lambda: rec.order.append("ddp"))

    a.register_hook(first)
    b.register_hook(later)
    for _ in range(2):
        ((a * 2).sum() + (b * 3).sum()).backward()
    assert rec.order == ["hook", "hook", "ddp", "end"] * 2


def test_grad_stamp_changes_when_grad_is_written():
    p = torch.nn.Parameter(torch.ones(3))
    assert grad_stamp(p) is None
    (p * 2).sum().backward()
    stamp = grad_stamp(p)
    assert grad_stamp(p) == stamp
    torch.nn.utils.clip_grad_norm_([p], 0.1)  # in place, through .detach()
    assert grad_stamp(p) != stamp
    stamp = grad_stamp(p)
    p.grad = p.grad.clone()
    assert grad_stamp(p) != stamp
