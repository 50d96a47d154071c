"""fuyou.stream_parameters and fuyou.AdamW(offload_params=True) (issue 12,
items 2 and 4): the working weights live in fuyoud and are streamed into the
model module by module.

Every training test trains a model twice from the same initial weights on the
same data: through stream_parameters, and fully resident with
torch.optim.AdamW (fp32). After EVERY step each weight, read back from the
daemon (export_checkpoint: the fp32 masters, which in fp32 are the working
weights), must satisfy ``|a - b| <= 1e-6 + 1e-5 |b|`` with b torch's.

Each test runs against the in-process fake session and a real fuyoud (the
``backend`` fixture); the daemon variant needs the daemon side of issue 12
(FetchWeights) and is skipped with a reason until the binding has it.
"""

from __future__ import annotations

import copy
import itertools
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuyou
from fuyou._offload import OffloadedParams
from fuyou._weight_cache import WeightCache
from train_util import StreamGPT, stream_batch

HERE = Path(__file__).resolve().parent
RTOL, ATOL = 1e-5, 1e-6
LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1
CHUNK_BYTES = 8 << 10  # fc weights (16 KiB) take two chunks; a module never shares one
_jobs = itertools.count()


def _binding_streams() -> bool:
    try:
        from fuyou import _native
        return hasattr(_native.module().Session, "send_fetch_weights")
    except Exception:
        return False


@pytest.fixture
def stream_backend(backend):
    if backend.name == "daemon" and not _binding_streams():
        pytest.skip("fuyou._fuyou.Session has no send_fetch_weights yet (issue 12's binding)")
    return backend


def torch_adamw(params):
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)


def offload_adamw(backend, params, **kw):
    kw.setdefault("job", f"stream-{os.getpid()}-{next(_jobs)}")
    return backend.adamw(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                         chunk_bytes=CHUNK_BYTES, num_slots=3, offload_params=True, **kw)


def assert_matches_daemon(opt, ref, step, what):
    """The daemon's weights (export_checkpoint, keyed by parameter index, the
    order of ref.parameters()) within ATOL + RTOL*|b| of torch's."""
    weights = opt.export_checkpoint()["model"]
    names = [n for n, _ in ref.named_parameters()]
    for i, (name, b) in enumerate(zip(names, ref.parameters())):
        a, b = weights[i].double(), b.detach().double()
        assert a.shape == b.shape, (name, a.shape, b.shape)
        err = (a - b).abs()
        if not bool((err <= ATOL + RTOL * b.abs()).all()):
            pytest.fail(f"{what}: after step {step}, {name} differs from torch.optim.AdamW by up "
                        f"to {err.max().item():.3g}", pytrace=False)


def model_bytes(opt) -> int:
    return sum(b.nbytes for b in opt.offload.blocks)


# ----------------------------------------------------------------- sizes
def test_parse_size_takes_the_daemons_units():
    assert fuyou.parse_size("64MiB") == 64 << 20
    assert fuyou.parse_size("1.5GiB") == 3 << 29
    assert fuyou.parse_size(" 2 kib ") == 2048
    assert fuyou.parse_size("1073741824") == 1 << 30
    assert fuyou.parse_size("3MB") == 3_000_000 and fuyou.parse_size("2G") == 2 * 10 ** 9
    assert fuyou.parse_size(4096) == 4096
    for bad in ("", "MiB", "12XB", "-1", "1e3", None, True, -5):
        with pytest.raises(ValueError):
            fuyou.parse_size(bad)


# ------------------------------------------------------------ registration
def test_register_module_api_and_placeholders(stream_backend):
    torch.manual_seed(0)
    model = StreamGPT(n_layer=1)
    shapes = [tuple(p.shape) for p in model.parameters()]
    opt = offload_adamw(stream_backend, model.parameters())
    try:
        assert isinstance(opt.offload, OffloadedParams)
        assert not opt.offload.job_exists and not opt.offload.bound
        opt.offload.bind(model)
        # Chunks follow modules: no chunk holds two modules' own parameters.
        owner = {}
        for name, m in model.named_modules():
            for p in m.parameters(recurse=False):
                owner.setdefault(id(p), name)
        for c in opt.pipeline.plan.chunks:
            assert len({owner[id(s.param)] for s in c.segments}) == 1, c
        assert not opt.offload.registered
        assert opt.offload.register_module(model.blocks[0].fc) is False  # new job
        assert model.blocks[0].fc.weight.numel() == 0  # released: an empty placeholder
        assert model.tok.weight.numel() > 0
        assert opt.offload.register_module(model.head) is False  # its weight is tok's
        assert model.tok.weight.numel() > 0
        for m in model.modules():
            opt.offload.register_module(m)
        assert opt.offload.registered
        assert all(p.numel() == 0 for p in model.parameters())
        assert opt.pipeline.param_shapes == shapes
    finally:
        opt.close()
    assert opt_of_plain_adamw_has_no_offload(stream_backend)


def opt_of_plain_adamw_has_no_offload(backend) -> bool:
    opt = backend.adamw(nn.Linear(2, 2).parameters())
    try:
        return opt.offload is None
    finally:
        opt.close()


def test_job_exists_with_chunks_but_no_step(stream_backend):
    """A job whose chunks were registered but that never committed a step
    exists (the daemon's job list says so); asked once, before this
    optimizer's own registrations."""
    if stream_backend.name != "daemon":
        pytest.skip("the fake has no job list")
    job = f"stream-nostep-{os.getpid()}-{next(_jobs)}"
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = offload_adamw(stream_backend, model.parameters(), job=job)
    assert not opt.offload.job_exists
    fuyou.stream_parameters(model, opt, device_budget=0)
    assert not opt.offload.job_exists  # its own chunks do not count
    opt.close()
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = offload_adamw(stream_backend, model.parameters(), job=job)
    try:
        assert opt.committed_step == 0 and opt.offload.job_exists
    finally:
        opt.close()


def test_resumed_job_registers_modules_built_on_meta(stream_backend):
    """A resumed job: the daemon's committed weights win; the modules' values
    (here on the meta device) are ignored."""
    torch.manual_seed(0)
    model, ref = StreamGPT(n_layer=1, tied=False), None
    ref = copy.deepcopy(model)
    ref_opt = torch_adamw(ref.parameters())
    job = f"stream-meta-{os.getpid()}-{next(_jobs)}"
    opt = offload_adamw(stream_backend, model.parameters(), job=job)
    fuyou.stream_parameters(model, opt, device_budget="1MiB")
    for step in range(2):
        for m, o in ((ref, ref_opt), (model, opt)):
            m(*stream_batch(step)).backward()
            o.step()
            o.zero_grad(set_to_none=True)
    opt.close()

    meta = StreamGPT(n_layer=1, tied=False)
    for m in meta.modules():  # as fuyou.init_empty would build it
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = nn.Parameter(torch.empty(p.shape, device="meta"))
    opt = offload_adamw(stream_backend, meta.parameters(), job=job)
    try:
        assert opt.offload.job_exists
        opt.offload.bind(meta)
        for m in meta.modules():
            opt.offload.register_module(m, device="cpu")
        assert opt.resumed and opt.committed_step == 2
        assert all(p.device.type == "cpu" for p in meta.parameters())
        assert opt.param_groups[0]["params"][0] is next(meta.parameters())
        fuyou.stream_parameters(meta, opt, device_budget="1MiB")
        for step in range(2, 4):
            for m, o in ((ref, ref_opt), (meta, opt)):
                m(*stream_batch(step)).backward()
                o.step()
                o.zero_grad(set_to_none=True)
            assert_matches_daemon(opt, ref, step, "resumed from meta")
    finally:
        opt.close()


# ---------------------------------------------------------------- training
def test_gpt_8x_the_budget_trains_10_steps_like_torch(stream_backend):
    """A GPT whose working weights are >= 8x device_budget: 10 steps, every
    step within fp32 tolerance of torch, and live bytes within budget + the
    largest module."""
    torch.manual_seed(0)
    model = StreamGPT(n_layer=8)
    ref = copy.deepcopy(model)
    ref_opt = torch_adamw(ref.parameters())
    opt = offload_adamw(stream_backend, model.parameters())
    budget = 48 << 10
    handle = fuyou.stream_parameters(model, opt, device_budget="48KiB", prefetch=2)
    try:
        total = model_bytes(opt)
        largest = handle.largest_module_bytes
        assert total >= 8 * budget, (total, budget)
        for step in range(10):
            ref(*stream_batch(step)).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            model(*stream_batch(step)).backward()
            opt.step()
            opt.zero_grad()
            assert_matches_daemon(opt, ref, step, "GPT 8x the budget")
            assert 0 < handle.peak_live_bytes <= budget + largest, (
                handle.peak_live_bytes, budget, largest)
        assert opt.committed_step == 10
        assert opt.loop_stats.speculative_updates > 0  # sent during backward
        with torch.no_grad():  # evaluation streams too (nothing saved for backward)
            x, y = stream_batch(100)
            torch.testing.assert_close(model(x, y), ref(x, y), rtol=1e-4, atol=1e-5)
        assert handle.fetches >= 2 * 10 * len(opt.pipeline.plan.chunks) * 0.5
        assert handle.prefetches > 0
        print(f"\nstream GPT: {total} bytes of weights, budget {budget}, largest module "
              f"{largest}, peak live {handle.peak_live_bytes}, {handle.fetches} chunk fetches, "
              f"({handle.prefetches} ahead), {handle.cache_hits} cache hits in 10 steps")
    finally:
        handle.close()
        opt.close()


def test_bf16_streaming_is_bitwise_the_resident_fuyou_run(stream_backend):
    """bf16 working weights: streamed, the model computes with the daemon's
    stored bf16 weights exactly as a resident model with fuyou.AdamW computes
    with the installed ones: the same weights after every step, bit for bit."""
    torch.manual_seed(0)
    model = StreamGPT(n_layer=2).to(torch.bfloat16)
    resident = copy.deepcopy(model)
    res_opt = stream_backend.adamw(resident.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                   weight_decay=WD, chunk_bytes=CHUNK_BYTES)
    opt = offload_adamw(stream_backend, model.parameters())
    handle = fuyou.stream_parameters(model, opt, device_budget="16KiB")
    try:
        for step in range(4):
            for m, o in ((resident, res_opt), (model, opt)):
                m(*stream_batch(step)).backward()
                o.step()
                o.zero_grad()
            got = opt.export_checkpoint()["model"]
            want = res_opt.export_checkpoint()["model"]
            for i in want:
                assert torch.equal(got[i], want[i]), f"step {step}, parameter {i}"
            # The working weights the next forward fetches are the masters in bf16.
            handle_live = handle.live_bytes
            for b in opt.offload.blocks:
                opt.offload.weights.acquire(b)
                for mem in b.members:
                    assert mem.param.dtype == torch.bfloat16
                    assert torch.equal(mem.param.detach().float(),
                                       got[mem.index].to(torch.bfloat16).float())
                opt.offload.weights.release(b)
            assert handle.live_bytes <= max(handle_live, handle.device_budget)
    finally:
        handle.close()
        opt.close()
        res_opt.close()


class MixedDtypes(nn.Module):
    """One module with a bf16 matrix and an fp32 scale: two chunks of one block
    (the fp32 one starts at an aligned offset of the block's buffer)."""

    def __init__(self, d=20):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) .to(torch.bfloat16) * 0.2)
        self.scale = nn.Parameter(torch.ones(d) + 0.01 * torch.randn(d))
        self.head = nn.Linear(d, 5)

    def forward(self, x, y):
        h = (x.to(torch.bfloat16) @ self.w).float() * self.scale
        return F.cross_entropy(self.head(torch.tanh(h)), y)


def test_a_module_with_two_dtypes_streams_like_the_resident_run(stream_backend):
    torch.manual_seed(3)
    model = MixedDtypes()
    resident = copy.deepcopy(model)
    res_opt = stream_backend.adamw(resident.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                   weight_decay=WD, chunk_bytes=CHUNK_BYTES)
    opt = offload_adamw(stream_backend, model.parameters())
    handle = fuyou.stream_parameters(model, opt, device_budget=0)
    try:
        own = opt.offload.blocks[[b.name for b in opt.offload.blocks].index("")]
        assert {c.dtype for c in own.chunks} == {torch.bfloat16, torch.float32}
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)
            for m, o in ((resident, res_opt), (model, opt)):
                m(x, y).backward()
                o.step()
                o.zero_grad()
            got = opt.export_checkpoint()["model"]
            want = res_opt.export_checkpoint()["model"]
            for i in want:
                assert torch.equal(got[i], want[i]), f"step {step}, parameter {i}"
    finally:
        handle.close()
        opt.close()
        res_opt.close()


def test_overlap_off_sends_at_step(stream_backend):
    """overlap=False: the complete chunks wait on the host and go at step()."""
    torch.manual_seed(1)
    model = TwiceNet()
    ref = copy.deepcopy(model)
    ref_opt = torch_adamw(ref.parameters())
    opt = offload_adamw(stream_backend, model.parameters(), overlap=False)
    handle = fuyou.stream_parameters(model, opt, device_budget="4KiB")
    try:
        for step in range(3):
            for m, o in ((ref, ref_opt), (model, opt)):
                m(*twice_batch(step), step=step).backward()
                o.step()
                o.zero_grad(set_to_none=True)
            assert_matches_daemon(opt, ref, step, "overlap off")
        assert opt.loop_stats.speculative_updates == 0
    finally:
        handle.close()
        opt.close()


def test_saved_weight_views_do_not_pin_released_buffers(stream_backend, monkeypatch):
    """F.linear saves weight.t() (a view of the fetched buffer) for backward:
    the saved-tensor hooks keep every saved tensor that lives in a fetched
    buffer as a handle, not as a tensor, so nothing keeps a released buffer's
    memory alive between forward and backward (budget 0: no cache), and
    backward (which fetches again) still matches torch."""
    from fuyou._stream import ParameterStream

    torch.manual_seed(0)
    model = StreamGPT(n_layer=2)
    ref = copy.deepcopy(model)
    ref_opt = torch_adamw(ref.parameters())
    opt = offload_adamw(stream_backend, model.parameters())
    buffers, packed = [], []
    load, pack = WeightCache._load, ParameterStream._pack

    def recording_load(self, block):
        load(self, block)
        buffers.append(weakref.ref(block.buffer))

    def recording_pack(self, t):
        out = pack(self, t)
        ptr = t.data_ptr() if t.numel() else -1
        inside = any(b.buffer.data_ptr() <= ptr < b.buffer.data_ptr() + b.nbytes
                     for b in opt.offload.blocks if b.buffer is not None)
        packed.append((inside, out is t))
        return out

    monkeypatch.setattr(WeightCache, "_load", recording_load)
    monkeypatch.setattr(ParameterStream, "_pack", recording_pack)
    handle = fuyou.stream_parameters(model, opt, device_budget=0, prefetch=1)
    try:
        for step in range(2):
            buffers.clear()
            packed.clear()
            loss = model(*stream_batch(step))
            assert buffers, "nothing was fetched"
            in_buffers = [kept for inside, kept in packed if inside]
            assert len(in_buffers) >= 4 * 2, "weights (or views of them) were saved for backward"
            assert not any(in_buffers), "a saved tensor in a fetched buffer was kept as a tensor"
            alive = [r for r in buffers if r() is not None]
            assert not alive, f"{len(alive)} of {len(buffers)} released buffers are still alive"
            assert handle.live_bytes == 0
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref(*stream_batch(step)).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            assert_matches_daemon(opt, ref, step, "saved views")
    finally:
        handle.close()
        opt.close()


class TwiceNet(nn.Module):
    """`shared` is called twice in one forward; `sometimes` only on even steps;
    `gated` uses its bias only on even steps (a chunk with a segment without a
    gradient); emb is tied to the head."""

    def __init__(self, vocab=32, d=24):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.shared = nn.Linear(d, d)
        self.sometimes = nn.Linear(d, d)
        self.gated = Gated(d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx, targets, step=0):
        x = self.emb(idx)
        x = x + torch.tanh(self.shared(x))
        x = x + torch.tanh(self.shared(x))  # the same module again
        if step % 2 == 0:
            x = x + self.sometimes(x)
        x = x + self.gated(x, use_bias=step % 2 == 0)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class Gated(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) * 0.1)
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x, use_bias):
        return F.linear(x, self.weight, self.bias if use_bias else None)


def twice_batch(step, vocab=32, micro=0):
    g = torch.Generator().manual_seed(31 * step + micro)
    data = torch.randint(0, vocab, (4, 9), generator=g)
    return data[:, :-1], data[:, 1:]


def _train_twice_net(backend, steps, what, accumulation=1, max_grad_norm=None,
                     budget="4KiB"):
    torch.manual_seed(1)
    model = TwiceNet()
    ref = copy.deepcopy(model)
    ref_opt = torch_adamw(ref.parameters())
    kw = {}
    if accumulation > 1:
        kw["accumulation_steps"] = accumulation
    opt = offload_adamw(backend, model.parameters(), max_grad_norm=max_grad_norm, **kw)
    handle = fuyou.stream_parameters(model, opt, device_budget=budget, prefetch=2)
    clipped = 0
    try:
        for step in range(steps):
            for m in (ref, model):
                for i in range(accumulation):
                    x, y = twice_batch(step, micro=i)
                    (m(x, y, step=step) / accumulation).backward()
            if max_grad_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
                clipped += bool(max_grad_norm / (float(norm) + 1e-6) < 1.0)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert_matches_daemon(opt, ref, step, what)
        assert opt.committed_step == steps
        # torch's per-parameter step counts (a parameter without a gradient is
        # not updated) are the daemon's.
        state = opt.export_checkpoint()["optimizer"]["state"]
        for i, p in enumerate(ref.parameters()):
            want = ref_opt.state[p].get("step") if p in ref_opt.state else None
            got = state.get(i, {}).get("step")
            assert (None if want is None else float(want)) == (None if got is None else float(got))
        return opt, handle, clipped
    finally:
        handle.close()
        opt.close()


def test_tied_twice_called_and_gradientless_parameters(stream_backend):
    """A module called twice per forward, an embedding tied to the LM head, a
    module without gradients on odd steps and a bias without one on odd steps."""
    _train_twice_net(stream_backend, 6, "tied + twice + no-grad")


def test_max_grad_norm_that_clips(stream_backend):
    _opt, _h, clipped = _train_twice_net(stream_backend, 4, "max_grad_norm", max_grad_norm=0.05)
    assert clipped == 4


def test_accumulation_steps_2(stream_backend):
    _train_twice_net(stream_backend, 4, "accumulation_steps=2", accumulation=2)


def test_accumulation_with_max_grad_norm(stream_backend):
    _train_twice_net(stream_backend, 3, "accumulation + clip", accumulation=2, max_grad_norm=0.05)


def test_zero_grad_without_step_rolls_the_step_back(stream_backend):
    torch.manual_seed(1)
    model = TwiceNet()
    ref = copy.deepcopy(model)
    ref_opt = torch_adamw(ref.parameters())
    opt = offload_adamw(stream_backend, model.parameters())
    handle = fuyou.stream_parameters(model, opt, device_budget="4KiB")
    try:
        for step in range(4):
            skip = step == 1
            for m, o in ((ref, ref_opt), (model, opt)):
                m(*twice_batch(step), step=step).backward()
                if not skip:
                    o.step()
                o.zero_grad(set_to_none=True)
            assert_matches_daemon(opt, ref, step, "skipped step")
        assert opt.committed_step == 3
        assert opt.loop_stats.rolled_back_skipped > 0
    finally:
        handle.close()
        opt.close()


def test_own_loss_scale_overflow_skips_the_step(stream_backend):
    """loss_scale=1024 and opt.scale_loss(loss); an inf gradient in step 2 (in
    `shared`, late in backward: later modules were already sent) skips that
    step as GradScaler would: rolled back, nothing committed."""
    steps, inf_at, scale = 4, 2, 1024.0
    torch.manual_seed(1)
    model = TwiceNet()
    ref = copy.deepcopy(model)
    ref_opt = torch_adamw(ref.parameters())
    opt = offload_adamw(stream_backend, model.parameters(), loss_scale=scale)
    handle = fuyou.stream_parameters(model, opt, device_budget="4KiB")
    try:
        for step in range(steps):
            hooks = []
            if step == inf_at:
                hooks = [m.shared.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
                         for m in (ref, model)]
            (ref(*twice_batch(step), step=step) * scale).backward()
            if step != inf_at:
                for p in ref.parameters():
                    if p.grad is not None:
                        p.grad.div_(scale)
                ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            opt.scale_loss(model(*twice_batch(step), step=step)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            for h in hooks:
                h.remove()
            assert_matches_daemon(opt, ref, step, "loss scale overflow")
        assert opt.skipped_steps == 1 and opt.committed_step == steps - 1
        assert opt.loop_stats.rolled_back_skipped > 0
    finally:
        handle.close()
        opt.close()


def test_backward_after_step_is_refused(stream_backend):
    """A graph kept past step() (retain_graph) holds handles of the previous
    step's weights: its backward raises instead of computing with new weights."""
    torch.manual_seed(0)
    model = StreamGPT(n_layer=1)
    opt = offload_adamw(stream_backend, model.parameters())
    handle = fuyou.stream_parameters(model, opt, device_budget=0)
    try:
        loss = model(*stream_batch(0))
        loss.backward(retain_graph=True)
        opt.step()
        opt.zero_grad()
        # Raised in the unpack hook: autograd passes it on as a RuntimeError.
        with pytest.raises(RuntimeError, match="FAILED_PRECONDITION.*backward before optimizer.step"):
            loss.backward()
        opt.zero_grad()
        model(*stream_batch(1)).backward()  # the next step goes on
        opt.step()
        assert opt.committed_step == 2
    finally:
        handle.close()
        opt.close()


def test_stream_parameters_needs_offload_params(stream_backend):
    model = nn.Linear(3, 3)
    opt = stream_backend.adamw(model.parameters())
    try:
        with pytest.raises(fuyou.InvalidArgument, match="offload_params"):
            fuyou.stream_parameters(model, opt)
    finally:
        opt.close()


# ------------------------------------------------------------------ resume
def test_resume_after_a_new_session_or_a_daemon_restart(stream_backend, tmp_path):
    """Train 3 steps, close, restart the daemon (a new process on the same data
    dir; with the fake: a new session), open the job again with a model built
    from other weights, and go on: the daemon's committed weights win and the
    run matches torch trained without interruption."""
    from conftest import start_daemon

    torch.manual_seed(0)
    model = StreamGPT(n_layer=2)
    ref = copy.deepcopy(model)
    ref_opt = torch_adamw(ref.parameters())
    job = f"stream-restart-{os.getpid()}-{next(_jobs)}"
    daemon = None
    backend = stream_backend
    if backend.name == "daemon":
        daemon = start_daemon(tmp_path, "restart")
        backend = type(backend)("daemon", daemon.address, daemon)
    try:
        opt = offload_adamw(backend, model.parameters(), job=job)
        handle = fuyou.stream_parameters(model, opt, device_budget="32KiB")
        for step in range(3):
            for m, o in ((ref, ref_opt), (model, opt)):
                m(*stream_batch(step)).backward()
                o.step()
                o.zero_grad(set_to_none=True)
        handle.close()
        opt.close()
        if daemon is not None:
            daemon.stop()
            daemon = start_daemon(tmp_path, "restart")
            backend = type(backend)("daemon", daemon.address, daemon)

        torch.manual_seed(123)  # other initial weights: they must be ignored
        again = StreamGPT(n_layer=2)
        opt = offload_adamw(backend, again.parameters(), job=job)
        assert opt.offload.job_exists
        handle = fuyou.stream_parameters(again, opt, device_budget="32KiB")
        assert opt.resumed and opt.committed_step == 3
        for step in range(3, 6):
            for m, o in ((ref, ref_opt), (again, opt)):
                m(*stream_batch(step)).backward()
                o.step()
                o.zero_grad(set_to_none=True)
            assert_matches_daemon(opt, ref, step, "after restart")
        handle.close()
        opt.close()
    finally:
        if daemon is not None:
            daemon.stop()


def _worker(daemon, job, out, hang_at=-1, steps=8):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(HERE.parents[1] / "python_client"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(HERE / "resume_worker.py"), "--address", daemon.address,
           "--job", job, "--steps", str(steps), "--out", str(out),
           "--hang-at-step", str(hang_at), "--offload"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.mark.slow
def test_sigkill_mid_step_then_resume_streams_on(daemon, tmp_path):
    """A streaming job SIGKILLed in the middle of step 5 (backward sent chunks)
    resumes at step 4 in a new process and ends where an uninterrupted run ends
    (bit for bit), which matches torch."""
    if not _binding_streams():
        pytest.skip("fuyou._fuyou.Session has no send_fetch_weights yet (issue 12's binding)")
    steps, hang_at, pid = 8, 5, os.getpid()
    full = _worker(daemon, f"stream-full-{pid}", tmp_path / "full.pt", steps=steps)
    out, _ = full.communicate(timeout=180)
    assert full.returncode == 0, out

    proc = _worker(daemon, f"stream-killed-{pid}", tmp_path / "unused.pt", hang_at=hang_at)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(f"mid-step {hang_at}"):
            break
    assert lines and lines[-1].startswith(f"mid-step {hang_at}"), "".join(lines)
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()

    again = _worker(daemon, f"stream-killed-{pid}", tmp_path / "resumed.pt", steps=steps)
    out, _ = again.communicate(timeout=180)
    assert again.returncode == 0, out
    assert f"opened resumed=True committed={hang_at - 1}" in out, out
    a, b = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")

    # And the uninterrupted run is torch's (the worker's loop, resident).
    from resume_worker import torch_reference
    for i, p in enumerate(torch_reference(steps, offload=True)):
        err = (a[i].double() - p.detach().double()).abs()
        assert bool((err <= ATOL + RTOL * p.detach().double().abs()).all()), (i, err.max())
