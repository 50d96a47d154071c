"""Optimizer behaviours beyond parity: overlap with backward, unused and frozen
parameters, zero_grad, closures, the embedded switch."""

import pytest
import torch
import torch.nn as nn

import fuyou
from conftest import require_daemon
from helpers import make_model
from train_util import CHUNK_BYTES, step_loss


def test_daemon_updates_chunks_during_backward(daemon):
    model = make_model()
    opt = fuyou.AdamW(model.parameters(), job=f"overlap-{id(model)}", address=daemon.address,
                      chunk_bytes=CHUNK_BYTES, num_slots=2, timeout=20.0)
    before = fuyou.admin_stats(daemon.address)["chunk_updates"]
    step_loss(model, 0).backward()
    opt.pipeline.wait_sent()  # the hooks only enqueue; the sender thread sends
    during = fuyou.admin_stats(daemon.address)["chunk_updates"]
    # With 2 slots, every chunk but the last two was sent and its new weights
    # collected (staged) by the sender thread before step().
    assert during - before >= opt.num_chunks - 2
    opt.step()
    assert fuyou.admin_stats(daemon.address)["chunk_updates"] - before == opt.num_chunks
    opt.close()


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.unused = nn.Linear(300, 300)  # its own chunks; never gets a gradient
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.frozen(self.used(x)).square().mean()


def test_unused_and_frozen_parameters_are_left_alone(backend):
    torch.manual_seed(0)
    model = WithUnused()
    ref = WithUnused()
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad])
    # A parameter without a gradient is skipped when its chunks hold nothing else;
    # its own parameter group guarantees that (chunks never mix groups).
    groups = [{"params": list(model.used.parameters()) + list(model.frozen.parameters())},
              {"params": list(model.unused.parameters())}]
    opt = backend.adamw(groups, chunk_bytes=CHUNK_BYTES)
    assert opt.num_chunks > 40
    unused = [p.detach().clone() for p in model.unused.parameters()]
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        ref(x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(x).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        assert opt.committed_step == step + 1
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    for p, u in zip(model.unused.parameters(), unused):
        assert torch.equal(p, u)
    opt.close()


def test_closure_and_step_without_gradients(fake_backend):
    model = make_model()
    opt = fake_backend.adamw(model.parameters(), chunk_bytes=CHUNK_BYTES)
    opt.step()  # no gradient at all: nothing to update, nothing committed
    assert opt.committed_step == 0

    def closure():
        opt.zero_grad()
        loss = step_loss(model, 0)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() > 0 and opt.committed_step == 1


def test_closed_optimizer_refuses_steps(fake_backend):
    model = make_model()
    with fake_backend.adamw(model.parameters(), chunk_bytes=CHUNK_BYTES) as opt:
        pass
    with pytest.raises(fuyou.FailedPrecondition):
        opt.step()
    opt.close()  # idempotent


def test_embedded_true_starts_a_private_daemon(tmp_path, monkeypatch):
    binary = require_daemon()
    monkeypatch.setenv("FUYOU_DAEMON", binary)
    monkeypatch.setenv("FUYOU_DATA_DIR", str(tmp_path / "data"))
    model = make_model()
    opt = fuyou.AdamW(model.parameters(), job="private", embedded=True,
                      chunk_bytes=CHUNK_BYTES)
    d = opt.embedded_daemon
    assert d is not None and d.running() and opt.address == d.address
    step_loss(model, 0).backward()
    opt.step()
    assert opt.committed_step == 1
    opt.close()
    assert not d.running()
