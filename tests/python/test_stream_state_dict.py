"""state_dict and load_state_dict of a streamed model (issue 19, item 3).

After streamed training ``model.state_dict()`` must hold the trained weights
(not the empty placeholders), ``torch.save``/``torch.load`` of it must load into
a plain model and into a fresh streamed one, and ``model.load_state_dict`` into
a streamed model must write the values into the daemon (masters and working
weights; moments and step counts stay, as torch's load leaves the optimizer
alone). The references are the same models trained fully resident with
``torch.optim.AdamW``: within ``|a - b| <= 1e-6 + 1e-5 |b|``.

The state_dict tests run on the fake session and a real fuyoud (``stream_backend``);
those that load run on fuyoud only (the fake session has no WriteState).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

import fuyou
from conftest import Backend
from test_stream_parameters import (ATOL, LR, RTOL, assert_matches_daemon, offload_adamw,
                                    stream_backend, torch_adamw, _binding_streams)  # noqa: F401
from train_util import StreamGPT, stream_batch

_seeds = itertools.count(100)


@pytest.fixture
def real(daemon):
    if not _binding_streams():
        pytest.skip("fuyou._fuyou.Session has no send_fetch_weights yet (issue 12's binding)")
    return Backend("daemon", daemon.address, daemon)


def _train(model, opt, steps, first=0):
    for step in range(first, first + steps):
        model(*stream_batch(step)).backward()
        opt.step()
        opt.zero_grad()


def _pair(backend, n_layer=2, seed=0, dtype=torch.float32, budget="16KiB"):
    """A streamed StreamGPT, its torch twin (same initial weights) and their optimizers."""
    torch.manual_seed(seed)
    model = StreamGPT(n_layer=n_layer).to(dtype)
    ref = copy.deepcopy(model)
    ref_opt = torch_adamw(ref.parameters())
    opt = offload_adamw(backend, model.parameters())
    handle = fuyou.stream_parameters(model, opt, device_budget=budget)
    return model, ref, opt, ref_opt, handle


def _close(a, b):
    a, b = a.detach().double(), b.detach().double()
    return a.shape == b.shape and bool(((a - b).abs() <= ATOL + RTOL * b.abs()).all())


def _daemon_weights(opt, model):
    """name -> the daemon's committed fp32 master of each trained parameter."""
    ckpt = opt.export_checkpoint(model=model)["model"]
    return {n: ckpt[n] for n, _ in model.named_parameters()}


def _loss(model, step=50):
    with torch.no_grad():
        return model(*stream_batch(step))


# ------------------------------------------------------------------ state_dict
def test_saved_state_dict_loads_into_a_plain_model(stream_backend, tmp_path):
    model, ref, opt, ref_opt, handle = _pair(stream_backend)
    try:
        _train(model, opt, 3)
        _train(ref, ref_opt, 3)
        sd = model.state_dict()
        want = ref.state_dict()
        assert list(sd) == list(want)
        for name, t in sd.items():
            assert t.shape == want[name].shape and t.dtype == want[name].dtype, name
        # A tied parameter: one tensor under both names, as torch gives it.
        assert sd["head.weight"].data_ptr() == sd["tok.weight"].data_ptr()
        # keep_vars=True: the parameters themselves, as torch (fuyou's exports rely on it).
        kept = model.state_dict(keep_vars=True)
        assert kept["blocks.0.fc.weight"] is model.blocks[0].fc.weight
        assert all(p.numel() == 0 for p in model.parameters())  # placeholders again
        torch.save(sd, tmp_path / "model.pt")
        del sd

        loaded = torch.load(tmp_path / "model.pt")
        torch.manual_seed(1234)
        plain = StreamGPT(n_layer=2)
        plain.load_state_dict(loaded)
        daemon = _daemon_weights(opt, model)
        for name, p in plain.named_parameters():
            assert torch.equal(p.detach(), daemon[name]), name
            assert _close(p, dict(ref.named_parameters())[name]), name
        for name, b in plain.named_buffers():
            assert torch.equal(b, dict(ref.named_buffers())[name]), name
        torch.testing.assert_close(_loss(plain), _loss(ref), rtol=1e-4, atol=1e-6)
        assert torch.equal(_loss(plain), _loss(model))  # the same weights, the same ops
    finally:
        handle.close()
        opt.close()


def test_submodule_state_dict_and_frozen_parameters(stream_backend):
    torch.manual_seed(0)
    model = StreamGPT(n_layer=2)
    model.blocks[1].ln1.weight.requires_grad_(False)  # frozen: not streamed, as usual
    ref = copy.deepcopy(model)
    ref_opt = torch_adamw([p for p in ref.parameters() if p.requires_grad])
    opt = offload_adamw(stream_backend, [p for p in model.parameters() if p.requires_grad])
    handle = fuyou.stream_parameters(model, opt, device_budget="16KiB")
    try:
        _train(model, opt, 2)
        _train(ref, ref_opt, 2)
        for sub, ref_sub in ((model.blocks[1], ref.blocks[1]),
                             (model.blocks[0].attn, ref.blocks[0].attn),
                             (model.blocks[1].fc, ref.blocks[1].fc)):
            got, want = sub.state_dict(), ref_sub.state_dict()
            assert list(got) == list(want)
            for name in want:
                assert _close(got[name], want[name]), name
        got = model.blocks[1].state_dict(prefix="x.")
        assert "x.ln1.weight" in got and torch.equal(got["x.ln1.weight"], ref.blocks[1].ln1.weight)
        assert model.blocks[1].ln1.weight.numel() > 0  # frozen: kept in the model
    finally:
        handle.close()
        opt.close()


def test_bf16_state_dict_is_the_daemons_working_weights(stream_backend):
    model, _ref, opt, _ref_opt, handle = _pair(stream_backend, dtype=torch.bfloat16)
    try:
        _train(model, opt, 2)
        sd = model.state_dict()
        daemon = _daemon_weights(opt, model)
        for name, p in model.named_parameters():
            assert sd[name].dtype == torch.bfloat16, name
            assert torch.equal(sd[name], daemon[name].to(torch.bfloat16)), name
        plain = StreamGPT(n_layer=2).to(torch.bfloat16)
        plain.load_state_dict(sd)
        assert torch.equal(_loss(plain), _loss(model))
    finally:
        handle.close()
        opt.close()


def test_state_dict_during_a_step_is_refused(stream_backend):
    model, _ref, opt, _ref_opt, handle = _pair(stream_backend)
    try:
        _train(model, opt, 1)
        before = model.state_dict()
        model(*stream_batch(1)).backward()
        with pytest.raises(fuyou.FailedPrecondition, match=r"after optimizer\.step\(\)"):
            model.state_dict()
        opt.step()
        opt.zero_grad()
        after = model.state_dict()
        assert not torch.equal(after["blocks.0.fc.weight"], before["blocks.0.fc.weight"])
    finally:
        handle.close()
        opt.close()


def test_size_limit_names_the_sharded_export(stream_backend, monkeypatch):
    model, _ref, opt, _ref_opt, handle = _pair(stream_backend)
    try:
        _train(model, opt, 1)
        total = sum(b.nbytes for b in opt.offload.blocks)
        handle.state_dict_limit_bytes = total - 1
        with pytest.raises(fuyou.FailedPrecondition) as e:
            model.state_dict()
        msg = str(e.value)
        assert "fuyou.export_checkpoint(opt, path, model, shard_bytes=" in msg
        assert "state_dict_limit_bytes" in msg and "FUYOU_STATE_DICT_LIMIT" in msg
        small = model.blocks[0].ln1.state_dict()  # a module that fits still saves
        assert small["weight"].numel() == 32
        handle.state_dict_limit_bytes = "1GiB"
        assert model.state_dict()["tok.weight"].numel() > 0
        # The default comes from the environment when set.
        monkeypatch.setenv("FUYOU_STATE_DICT_LIMIT", "1KiB")
        handle2 = fuyou.stream_parameters(model, opt, device_budget="16KiB")
        assert handle2.state_dict_limit_bytes == 1024
        with pytest.raises(fuyou.FailedPrecondition, match="export_checkpoint"):
            model.state_dict()
        handle2 = fuyou.stream_parameters(model, opt, state_dict_limit_bytes="64MiB")
        assert handle2.state_dict_limit_bytes == 64 << 20
        handle2.close()
    finally:
        handle.close()
        opt.close()
    monkeypatch.delenv("FUYOU_STATE_DICT_LIMIT")
    assert 0 < fuyou._stream_state_dict.default_state_dict_limit() <= 8 << 30


# ------------------------------------------------------------- load_state_dict
def test_load_state_dict_continues_like_torch(real):
    """A load between steps changes what the next forward computes with and
    what training continues from; the moments stay (torch's load leaves the
    optimizer alone too)."""
    model, ref, opt, ref_opt, handle = _pair(real)
    try:
        _train(model, opt, 3)
        _train(ref, ref_opt, 3)
        torch.manual_seed(next(_seeds))
        other = StreamGPT(n_layer=2).state_dict()
        other = {k: v + 0.01 for k, v in other.items()}
        ref.load_state_dict(other)
        assert model.load_state_dict(other) is not None
        assert opt.committed_step == 3
        got = model.state_dict()
        for name, v in other.items():
            assert torch.equal(got[name], v), name
        assert torch.equal(_loss(model), _loss(ref))
        _train(model, opt, 3, first=3)
        _train(ref, ref_opt, 3, first=3)
        assert_matches_daemon(opt, ref, 6, "after load_state_dict")
    finally:
        handle.close()
        opt.close()


def test_saved_state_dict_loads_into_a_fresh_streamed_model(real, tmp_path):
    model, ref, opt, ref_opt, handle = _pair(real)
    try:
        _train(model, opt, 3)
        _train(ref, ref_opt, 3)
        torch.save(model.state_dict(), tmp_path / "model.pt")
    finally:
        handle.close()
        opt.close()
    torch.manual_seed(next(_seeds))
    fresh = StreamGPT(n_layer=2)
    opt2 = offload_adamw(real, fresh.parameters())
    handle2 = fuyou.stream_parameters(fresh, opt2, device_budget="16KiB")
    try:
        fresh.load_state_dict(torch.load(tmp_path / "model.pt"))
        for name, p in ref.named_parameters():
            assert _close(fresh.state_dict()[name], p), name
        torch.testing.assert_close(_loss(fresh), _loss(ref), rtol=1e-4, atol=1e-6)
        # It trains on from the loaded weights (fresh moments: a new job), as
        # torch does from the same file.
        ref2 = copy.deepcopy(ref)
        ref2.load_state_dict(torch.load(tmp_path / "model.pt"))
        assert torch.equal(_loss(fresh), _loss(ref2))
        ref2_opt = torch_adamw(ref2.parameters())
        _train(fresh, opt2, 2, first=3)
        _train(ref2, ref2_opt, 2, first=3)
        assert_matches_daemon(opt2, ref2, 5, "fresh streamed model after load_state_dict")
    finally:
        handle2.close()
        opt2.close()


def test_load_errors_write_nothing(real):
    model, _ref, opt, _ref_opt, handle = _pair(real)
    try:
        _train(model, opt, 1)
        before = model.state_dict()
        bad = {k: v + 1.0 for k, v in before.items()}
        bad["blocks.1.fc.weight"] = torch.zeros(3, 3)
        with pytest.raises(RuntimeError, match=r"size mismatch for blocks\.1\.fc\.weight: copying "
                           r"a param with shape torch\.Size\(\[3, 3\]\) from checkpoint, the shape "
                           r"in current model is torch\.Size\(\[128, 32\]\)"):
            model.load_state_dict(bad)
        bad["blocks.1.fc.weight"] = "not a tensor"
        with pytest.raises(RuntimeError, match="expected torch.Tensor"):
            model.load_state_dict(bad)
        for name, t in model.state_dict().items():
            assert torch.equal(t, before[name]), name  # nothing written

        # strict, as torch: missing and unexpected keys.
        partial = {k: v + 1.0 for k, v in before.items() if not k.startswith("blocks.1.")}
        with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "blocks\.1\.'):
            model.load_state_dict(partial)
        extra = dict(before, **{"blocks.0.fc.nope": torch.zeros(1)})
        with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "blocks\.0\.fc\.nope"'):
            model.load_state_dict(extra)
        result = model.load_state_dict(partial, strict=False)
        assert sorted(result.missing_keys) == sorted(k for k in before if k.startswith("blocks.1."))
        assert result.unexpected_keys == []
        got = model.state_dict()
        for name, t in got.items():
            want = partial.get(name, before[name])
            assert torch.equal(t, want), name
        # A submodule's load: its own keys, no prefix.
        sub = {k: torch.full_like(v, 0.5) for k, v in model.blocks[1].fc.state_dict().items()}
        model.blocks[1].fc.load_state_dict(sub)
        assert torch.equal(model.state_dict()["blocks.1.fc.bias"], sub["bias"])
        opt.step()  # training goes on (nothing left pending in the daemon); the zero
        _train(model, opt, 1, first=1)  # .grad of zero_grad() on torch 1.13 is a step, as in torch
        assert opt.committed_step == 2 + (not fuyou.optimizer.SET_TO_NONE_DEFAULT)
    finally:
        handle.close()
        opt.close()


def test_load_during_a_step_is_refused(real):
    model, _ref, opt, _ref_opt, handle = _pair(real)
    try:
        _train(model, opt, 1)
        before = model.state_dict()
        model(*stream_batch(1)).backward()
        with pytest.raises(fuyou.FailedPrecondition, match=r"after optimizer\.step\(\)"):
            model.load_state_dict({k: v + 1.0 for k, v in before.items()})
        opt.step()
        opt.zero_grad()
        assert opt.committed_step == 2
        assert not torch.equal(model.state_dict()["tok.weight"], before["tok.weight"] + 1.0)
    finally:
        handle.close()
        opt.close()


def test_bf16_load_rounds_to_the_parameters_dtype(real):
    model, _ref, opt, _ref_opt, handle = _pair(real, dtype=torch.bfloat16)
    try:
        _train(model, opt, 1)
        torch.manual_seed(next(_seeds))
        values = StreamGPT(n_layer=2).state_dict()  # fp32 values into a bf16 model
        model.load_state_dict(values)
        plain = StreamGPT(n_layer=2).to(torch.bfloat16)
        plain.load_state_dict(values)  # torch rounds them in its copy
        got = model.state_dict()
        daemon = _daemon_weights(opt, model)
        for name, p in plain.named_parameters():
            assert torch.equal(got[name], p.detach()), name
            assert torch.equal(daemon[name], p.detach().float()), name  # the master too
        assert torch.equal(_loss(model), _loss(plain))
        _train(model, opt, 1, first=1)
    finally:
        handle.close()
        opt.close()


def test_state_dict_after_the_stream_or_the_optimizer_closed(stream_backend):
    model, ref, opt, ref_opt, handle = _pair(stream_backend)
    _train(model, opt, 1)
    _train(ref, ref_opt, 1)
    handle.close()  # the streaming hooks go; the weights are still the daemon's
    got = model.state_dict()
    for name, p in ref.named_parameters():
        assert _close(got[name], p), name
    opt.close()
    with pytest.raises(fuyou.FailedPrecondition, match="closed"):
        model.state_dict()  # never the empty placeholders


def test_backward_of_a_forward_before_a_load_is_refused(real):
    model, _ref, opt, _ref_opt, handle = _pair(real)
    try:
        _train(model, opt, 1)
        values = model.state_dict()
        loss = model(*stream_batch(1))  # saves weights for backward
        model.load_state_dict({k: v + 1.0 for k, v in values.items()})
        with pytest.raises(RuntimeError, match="load_state_dict replaced them"):
            loss.backward()
    finally:
        handle.close()
        opt.close()
