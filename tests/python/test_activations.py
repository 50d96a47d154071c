"""fuyou.offload_activations (issue 23, first slice): saved activations to host
memory or recomputed, by a per-layer plan; the planner on synthetic profiles.

Training tests train the same model from the same weights on the same data
with and without activation offload and compare gradients and weights with
torch.equal after every step: copies and recomputation change no value.
"""

from __future__ import annotations

import copy
import itertools
import os
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import fuyou
from fuyou._activation_plan import (HOST, KEEP, RECOMPUTE, SSD, LayerProfile, Profile,
                                    plan_activations, simulate)
from train_util import StreamGPT, stream_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python_client" / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

_jobs = itertools.count()


def small_gpt(n_layer=4):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=32, block_size=16))


def batch(step, seq=16, b=4):
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, 256, (b, seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def train(model, steps=3, after_backward=None):
    """Gradients of every step of a real AdamW training run."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads = []
    for step in range(steps):
        _, loss = model(*batch(step))
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if after_backward is not None:
            after_backward(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads, [p.detach().clone() for p in model.parameters()]


def assert_identical(ref, got):
    (ref_grads, ref_w), (grads, w) = ref, got
    for step, (a, b) in enumerate(zip(ref_grads, grads)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"step {step}: gradient of parameter {i} differs"
    for i, (x, y) in enumerate(zip(ref_w, w)):
        assert torch.equal(x, y), f"weight {i} differs after training"


class SavedBytesByLayer:
    """An independent count (the test's own saved-tensor hooks, on a model
    without offload) of the activation bytes each block saves, weights and
    buffers excluded, each tensor once."""

    def __init__(self, model):
        self.model, self.per_layer, self.outside, self.weights = model, {}, 0, 0
        self.current = None
        self.seen = []
        ptrs = {t.data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
        self.ptrs = ptrs
        for i, blk in enumerate(model.blocks):
            blk.register_forward_pre_hook(lambda m, a, i=i: setattr(self, "current", i))
            blk.register_forward_hook(lambda m, a, o: setattr(self, "current", None))

    def pack(self, t):
        base = t.data_ptr() - t.storage_offset() * t.element_size()
        if base in self.ptrs or isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            self.weights += 1
            return t
        if any(s is t for s in self.seen):
            return t
        self.seen.append(t)
        n = (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))) * t.element_size()
        if self.current is None:
            self.outside += n
        else:
            self.per_layer[self.current] = self.per_layer.get(self.current, 0) + n
        return t

    def forward(self, *args):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            return self.model(*args)


# ------------------------------------------------------------ gradients
@pytest.mark.parametrize("plan", ["host", "recompute", [KEEP, HOST, RECOMPUTE, HOST]])
def test_gradients_bit_identical_with_a_given_plan(plan):
    base = small_gpt()
    ref = train(copy.deepcopy(base))
    model = copy.deepcopy(base)
    with fuyou.offload_activations(model, plan=plan, min_bytes=0, verbose=False) as h:
        got = train(model)
        if plan != "recompute":
            assert h.store.traffic.bytes_moved_out > 0 and h.store.traffic.bytes_moved_back > 0
        else:
            assert h.store.traffic.bytes_moved_out == 0
    assert_identical(ref, got)


def test_planned_mixed_plan_is_bit_identical_and_within_budget(capsys):
    base = small_gpt()
    ref = train(copy.deepcopy(base), steps=4)
    model = copy.deepcopy(base)
    budget = 400 << 10
    peaks = []
    h = fuyou.offload_activations(model, device_budget=budget, min_bytes=0)
    got = train(model, steps=4, after_backward=lambda s: peaks.append(h.store.peak_device_bytes))
    assert_identical(ref, got)
    assert h.plan is not None and h.last_profile is not None
    assert h.choices.count(KEEP) < len(h.choices)  # the budget forces some change
    assert h.plan.predicted_device_peak <= budget
    assert all(p <= budget for p in peaks[1:]), peaks  # the first step is the profiled one
    out = capsys.readouterr().out
    assert "predicted step" in out and "blocks.0" in out
    h.remove()


def test_device_bytes_match_an_independent_count():
    """At the end of forward (CPU: every copy complete) the device holds
    exactly the kept layers' and the outside bytes, and the host the
    offloaded layers', as the test's own hooks count them."""
    base = small_gpt()
    counter = SavedBytesByLayer(copy.deepcopy(base))
    _, loss = counter.forward(*batch(0))
    plan = [KEEP, HOST, HOST, KEEP]
    model = copy.deepcopy(base)
    with fuyou.offload_activations(model, plan=plan, min_bytes=0, verbose=False) as h:
        _, loss = model(*batch(0))
        kept = counter.outside + counter.per_layer[0] + counter.per_layer[3]
        moved = counter.per_layer[1] + counter.per_layer[2]
        assert h.store.device_bytes == kept
        assert h.store.host_bytes == moved == h.store.traffic.bytes_moved_out
        assert h.weights_seen == counter.weights
        loss.backward()
        del loss
        assert h.store.device_bytes == 0 and h.store.host_bytes == 0  # all freed


# ------------------------------------------------------------ weights and buffers
class ScaledBlock(nn.Module):
    """Saves a view of its weight (w.t()) and a buffer for backward."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return torch.tanh(x @ self.w.t()) * self.scale + x


class ScaledNet(nn.Module):
    def __init__(self, d=64, n=3):
        super().__init__()
        self.blocks = nn.ModuleList(ScaledBlock(d) for _ in range(n))

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return None, F.mse_loss(x, y)


def test_parameters_and_buffers_are_never_offloaded():
    torch.manual_seed(1)
    model = ScaledNet()
    x, y = torch.randn(32, 64, requires_grad=True), torch.randn(32, 64)
    counter = SavedBytesByLayer(copy.deepcopy(model))
    counter.forward(x, y)
    assert counter.weights >= 6  # each block saves its weight view and its buffer
    ref_model = copy.deepcopy(model)
    with fuyou.offload_activations(model, plan="host", min_bytes=0, verbose=False) as h:
        _, loss = model(x, y)
        assert h.weights_seen == counter.weights
        assert h.store.traffic.bytes_moved_out == sum(counter.per_layer.values())
        loss.backward()
    _, ref_loss = ref_model(x, y)
    ref_loss.backward()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a.grad, b.grad)


# ------------------------------------------------------------ the planner
def synthetic(n=8, d2h=1e12, ssd=None, saved=100 << 20):
    layers = [LayerProfile(f"l{i}", forward_s=0.010, backward_s=0.020, saved_bytes=saved,
                           input_bytes=saved // 10) for i in range(n)]
    return Profile(layers=layers, d2h=d2h, h2d=d2h, ssd_write=ssd, ssd_read=ssd)


@pytest.mark.parametrize("n", [4, 8])  # 4: exhaustive search, 8: greedy and improvement
def test_planner_fast_link_offloads_to_host(n):
    prof = synthetic(n)
    budget = (n // 2) * (100 << 20) + (40 << 20)
    plan = plan_activations(prof, device_budget=budget, host_budget=1 << 40)
    assert set(plan.choices) <= {KEEP, HOST} and HOST in plan.choices, plan.choices
    keep_all = simulate(prof, [KEEP] * n).step_s
    assert plan.predicted_step_s == pytest.approx(keep_all, rel=1e-3)
    assert plan.predicted_device_peak <= budget


@pytest.mark.parametrize("n", [4, 8])
def test_planner_slow_link_recomputes(n):
    prof = synthetic(n, d2h=1e9)  # 100 MiB takes 105 ms, 5x a layer's backward
    plan = plan_activations(prof, device_budget=(n // 2) * (100 << 20), host_budget=1 << 40)
    assert RECOMPUTE in plan.choices and HOST not in plan.choices, plan.choices


@pytest.mark.parametrize("n", [4, 8])
def test_planner_without_host_memory_uses_a_fast_ssd_else_recomputes(n):
    budget = (n // 2) * (100 << 20) + (40 << 20)
    fast = plan_activations(synthetic(n, ssd=1e12), device_budget=budget, host_budget=0)
    assert SSD in fast.choices and set(fast.choices) <= {KEEP, SSD}, fast.choices
    assert fast.host_bytes == 0
    slow = plan_activations(synthetic(n, ssd=1e8), device_budget=budget, host_budget=0)
    assert RECOMPUTE in slow.choices and SSD not in slow.choices, slow.choices
    # no SSD bandwidth: the same as a slow one
    none = plan_activations(synthetic(n), device_budget=budget, host_budget=0)
    assert set(none.choices) <= {KEEP, RECOMPUTE}


def test_planner_cost_model_stalls_and_recompute_time():
    prof = synthetic(2, d2h=1e9)
    keep = simulate(prof, [KEEP, KEEP])
    assert keep.step_s == pytest.approx(0.06)
    rec = simulate(prof, [RECOMPUTE, KEEP])
    assert rec.step_s == pytest.approx(0.07)  # plus the layer's forward
    last = simulate(prof, [KEEP, HOST])  # out and back at once: nothing to hide behind
    assert last.stalls_s[1] == pytest.approx(2 * (100 << 20) / 1e9)


def test_planner_raises_when_nothing_fits():
    with pytest.raises(ValueError, match="no activation plan fits"):
        plan_activations(synthetic(4), device_budget=1 << 20, host_budget=0)


# ------------------------------------------------------------ the SSD tier
def _native():
    from fuyou import _native as native
    return native.module()


def _activation_files(d):
    """The daemon's activation scratch files (name -> bytes), over its storage paths."""
    return {str(f): f.stat().st_size for f in Path(d.data_dir).rglob("activations/*") if f.is_file()}


def test_ssd_tier_beyond_the_host_budget_is_bit_identical(daemon):
    ref = train(small_gpt())
    model = small_gpt()
    with fuyou.offload_activations(model, plan=SSD, host_budget=0, min_bytes=0,
                                   ssd=daemon.address, verbose=False) as h:
        got = train(model)
        store = h.store
        assert store.peak_ssd_bytes > 0 and store.ssd_bytes == 0
    assert_identical(ref, got)
    assert store.ssd.stats.bytes_spilled > 0  # all spills are written by remove()'s close
    assert store.ssd.stats.drops >= 3  # one per step at least: nothing alive after each backward
    stats = _native().AdminClient.connect(address=daemon.address).get_stats()
    assert stats["activation_spilled_bytes_total"] >= store.ssd.stats.bytes_spilled
    assert stats["activation_recalled_bytes_total"] == store.ssd.stats.bytes_recalled
    assert not any(_activation_files(daemon).values()), _activation_files(daemon)


def test_planner_ssd_choice_runs_beside_the_optimizer(daemon):
    # The planner's choice without host memory and with a fast SSD (as in
    # test_planner_without_host_memory_uses_a_fast_ssd_else_recomputes), run
    # at the optimizer's daemon, through a session of the tier's own.
    plan = plan_activations(synthetic(4, ssd=1e12), device_budget=int(2.5 * (100 << 20)),
                            host_budget=0)
    assert SSD in plan.choices, plan.choices
    model = small_gpt()
    session_opt = fuyou.AdamW([torch.zeros(8, requires_grad=True)], job=f"actssd-{os.getpid()}",
                              address=daemon.address, timeout=20.0)
    try:
        with fuyou.offload_activations(model, plan=plan, host_budget=0, min_bytes=0,
                                       ssd=session_opt, verbose=False) as h:
            assert h.choices == list(plan.choices)
            got = train(model, steps=3)
            assert h.store.ssd.session is not session_opt.pipeline.session
            assert h.store.ssd.owned_job.address == session_opt._address
            assert h.store.peak_ssd_bytes > 0
        assert h.store.ssd.stats.bytes_spilled > 0
        assert_identical(train(small_gpt(), steps=3), got)
    finally:
        session_opt.close()
    assert not _activation_files(daemon)
    jobs = [j["name"] for j in _native().AdminClient.connect(address=daemon.address).list_jobs()]
    assert f"actssd-{os.getpid()}" in jobs, jobs  # the listing is the daemon's
    assert not [j for j in jobs if j.startswith("activations-")], jobs  # the tier's job is deleted


def test_ssd_tier_errors_are_clear(daemon):
    native = _native()
    mine = native.Session.open(job=f"actssd-a-{os.getpid()}", num_slots=2, slot_bytes=8192,
                               address=daemon.address)
    theirs = native.Session.open(job=f"actssd-b-{os.getpid()}", num_slots=2, slot_bytes=8192,
                                 address=daemon.address)
    try:
        data = bytes(range(256)) * 100  # 25600 bytes: four pieces of one slot each
        mine.spill_activation(7, data)
        with pytest.raises(fuyou.InvalidArgument, match="already spilled"):
            mine.spill_activation(7, data)
        out = bytearray(len(data))
        with pytest.raises(fuyou.FuyouError, match="not spilled") as info:
            theirs.recall_activation(7, out)  # another session's key
        assert info.value.code == "NOT_FOUND"
        mine.recall_activation(7, out)
        assert bytes(out) == data
        with pytest.raises(fuyou.FuyouError, match="not spilled") as info:
            mine.recall_activation(7, out)  # recalled once
        assert info.value.code == "NOT_FOUND"
        mine.spill_activation(8, data)
        assert any(_activation_files(daemon).values())
    finally:
        mine.close()
        theirs.close()
    assert not _activation_files(daemon), "a closed session leaves no scratch file"


def test_ssd_tier_checksum_mismatch_is_data_loss(daemon):
    native = _native()
    s = native.Session.open(job=f"actssd-c-{os.getpid()}", num_slots=2, slot_bytes=8192,
                            address=daemon.address)
    try:
        s.spill_activation(1, b"\x11" * 4096)
        (path,) = [p for p, n in _activation_files(daemon).items() if n]
        with open(path, "r+b") as f:
            f.seek(100)
            f.write(b"\x22")
        with pytest.raises(fuyou.FuyouError, match="checksum") as info:
            s.recall_activation(1, bytearray(4096))
        assert info.value.code == "DATA_LOSS"
    finally:
        s.close()


def test_ssd_tier_user_limit_is_refused_clearly(tmp_path):
    from conftest import require_daemon
    d = fuyou.EmbeddedDaemon(data_dir=str(tmp_path / "data"), socket_path=str(tmp_path / "d.sock"),
                             extra_args=["--dram-budget", "64MiB", "--max-activation-bytes-per-user",
                                         "8KiB"], binary=require_daemon())
    try:
        native = _native()
        s = native.Session.open(job="limit", num_slots=2, slot_bytes=8192, address=d.address)
        s.spill_activation(1, b"x" * 4096)
        with pytest.raises(fuyou.FuyouError, match="max_activation_bytes_per_user") as info:
            s.spill_activation(2, b"y" * 4097)  # two more blocks: over the limit
        assert info.value.code == "RESOURCE_EXHAUSTED"
        s.spill_activation(3, b"z" * 4096)  # the refusal took nothing
        s.drop_activations()
        s.spill_activation(4, b"w" * 8192)  # the drop gave it all back
        s.close()
        # A run over the limit: the spills refused keep their host copies (logged),
        # and the gradients are still bit-identical.
        assert_a_run_over_the_limit_stays_identical(d.address, "max_activation_bytes_per_user")
    finally:
        d.stop()


def assert_a_run_over_the_limit_stays_identical(address, setting):
    """Trains through an SSD plan on a daemon whose `setting` refuses spills: the
    refused ones keep their host copies (logged), and the gradients are still
    bit-identical to a run without offload."""
    ref = train(small_gpt(), steps=2)
    model = small_gpt()
    with fuyou.offload_activations(model, plan=SSD, host_budget=0, min_bytes=0,
                                   ssd=address, verbose=False) as h:
        got = train(model, steps=2)
    assert h.store.ssd.stats.failed_spills > 0
    assert h.store.ssd.stats.last_error.code == "RESOURCE_EXHAUSTED"
    assert setting in str(h.store.ssd.stats.last_error)
    assert_identical(ref, got)


def test_ssd_tier_storage_budget_is_refused_clearly(tmp_path):
    """The scratch is admitted by the daemon's storage budget as a registration
    is (max_storage_bytes_per_user here): a spill over it is refused, naming
    the setting, and the session goes on."""
    from conftest import require_daemon
    d = fuyou.EmbeddedDaemon(data_dir=str(tmp_path / "data"), socket_path=str(tmp_path / "d.sock"),
                             extra_args=["--dram-budget", "64MiB", "--max-storage-per-user", "12KiB"],
                             binary=require_daemon())
    try:
        s = _native().Session.open(job="storage", num_slots=2, slot_bytes=16384, address=d.address)
        s.spill_activation(1, b"x" * 8192)
        with pytest.raises(fuyou.FuyouError, match="max_storage_bytes_per_user") as info:
            s.spill_activation(2, b"y" * 8192)  # 16 KiB in all: over the budget
        assert info.value.code == "RESOURCE_EXHAUSTED"
        for word in ("12288 bytes", "--max-storage-per-user", "the session goes on"):
            assert word in str(info.value), str(info.value)
        s.spill_activation(3, b"z" * 4096)  # the session goes on: 12 KiB fit
        out = bytearray(8192)
        s.recall_activation(1, out)
        assert bytes(out) == b"x" * 8192
        s.drop_activations()
        s.spill_activation(4, b"w" * 12288)  # the drop gave it all back
        s.close()
        assert_a_run_over_the_limit_stays_identical(d.address, "max_storage_bytes_per_user")
    finally:
        d.stop()


def test_killed_client_leaves_no_activation_scratch(daemon):
    import signal
    import subprocess
    import time
    worker = Path(__file__).with_name("activation_kill_worker.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, str(worker), daemon.address], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        line = proc.stdout.readline().split()
        assert line and line[0] == "spilled", line
        session_id = line[1]
        assert int(line[2]) > 0
        assert any(_activation_files(daemon).values())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    admin = _native().AdminClient.connect(address=daemon.address)
    # The daemon reaps the session when it sees the stream end, then closes it
    # (which unlinks the files): wait for both, bounded only against a hang.
    deadline = time.monotonic() + 60
    while (any(s["session_id"] == session_id for s in admin.list_sessions())
           or _activation_files(daemon)):
        assert time.monotonic() < deadline, \
            f"the killed client's session or scratch was never removed: {_activation_files(daemon)}"
        time.sleep(0.05)


def test_ssd_plan_without_an_ssd_tier_raises():
    model = small_gpt()
    with fuyou.offload_activations(model, plan=KEEP, verbose=False) as h:
        with pytest.raises(fuyou.FailedPrecondition, match="SSD tier"):
            h.apply([KEEP, SSD, KEEP, KEEP])
        assert h.choices == [KEEP] * 4


# ------------------------------------------------------------ composition
class UserCheckpointedGPT(nn.Module):
    """The GPT with block 1 under a non-reentrant and block 2 under a
    reentrant torch.utils.checkpoint of the user's own."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx, targets):
        g = self.gpt
        x = g.tok_emb(idx) + g.pos_emb(torch.arange(idx.shape[1]))
        for i, blk in enumerate(g.blocks):
            if i == 1:
                x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
            elif i == 2:
                x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=True)
            else:
                x = blk(x)
        logits = g.ln_f(x) @ g.tok_emb.weight.t()
        return None, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


@pytest.mark.parametrize("plan", ["host", "recompute", [HOST, RECOMPUTE, HOST, RECOMPUTE]])
def test_composes_with_a_users_checkpoint(plan):
    base = UserCheckpointedGPT(small_gpt())
    ref = train(copy.deepcopy(base))
    model = copy.deepcopy(base)
    with fuyou.offload_activations(model, plan=plan, min_bytes=0, verbose=False):
        got = train(model)
    assert_identical(ref, got)


def _binding_streams() -> bool:
    try:
        from fuyou import _native
        return hasattr(_native.module().Session, "send_fetch_weights")
    except Exception:
        return False


@pytest.mark.parametrize("plan", ["host", [HOST, RECOMPUTE]])
def test_composes_with_stream_parameters(backend, plan):
    """Streamed weights (fuyou.AdamW(offload_params=True)): the daemon's
    weights after every step equal those of the run without activation
    offload, and the saved weights stay the stream's."""
    if backend.name == "daemon" and not _binding_streams():
        pytest.skip("fuyou._fuyou.Session has no send_fetch_weights (issue 12's binding)")
    torch.manual_seed(0)
    base = StreamGPT(n_layer=2)
    results = []
    for offload in (False, True):
        model = copy.deepcopy(base)
        opt = backend.adamw(model.parameters(), lr=3e-3, weight_decay=0.1, chunk_bytes=8 << 10,
                            num_slots=3, offload_params=True,
                            job=f"act-{os.getpid()}-{next(_jobs)}")
        stream = fuyou.stream_parameters(model, opt, device_budget="1MiB")
        handle = (fuyou.offload_activations(model, plan=plan, min_bytes=0, verbose=False)
                  if offload else None)
        weights = []
        try:
            for step in range(3):
                model(*stream_batch(step)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                weights.append(opt.export_checkpoint()["model"])
            if handle is not None:
                assert handle.weights.stream is stream
                assert handle.weights_seen > 0 and handle.store.traffic.bytes_moved_out > 0
                handle.remove()
        finally:
            stream.close()
            opt.close()
        results.append(weights)
    for step, (a, b) in enumerate(zip(*results)):
        for k in a:
            assert torch.equal(a[k], b[k]), f"step {step}: weight {k} differs"


# ------------------------------------------------------------ remove
def _forward_state(model):
    return [(name, "forward" in m.__dict__, m.__dict__.get("forward"),
             dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks))
            for name, m in model.named_modules()]


def test_remove_restores_the_model_exactly():
    model = small_gpt()
    custom = model.blocks[2].forward  # an instance attribute the user set before
    model.blocks[2].forward = custom
    before = _forward_state(model)
    attrs = set(model.__dict__)
    h = fuyou.offload_activations(model, device_budget="400KiB", min_bytes=0, verbose=False)
    assert "forward" in model.blocks[0].__dict__
    train(model, steps=2)
    with pytest.raises(fuyou.InvalidArgument):
        fuyou.offload_activations(model)
    h.remove()
    h.remove()  # idempotent
    assert _forward_state(model) == before
    assert set(model.__dict__) == attrs
    assert model.blocks[2].forward is custom
    ref = small_gpt()
    ref.load_state_dict(model.state_dict())
    idx, tgt = batch(9)
    assert torch.equal(model(idx, tgt)[1], ref(idx, tgt)[1])
    weakref.ref(h)  # the handle may go; the model keeps nothing of it


# ------------------------------------------------------------ CUDA
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA device: side-stream copies to pinned host memory")
def test_cuda_host_offload_is_bit_identical_and_frees_device_memory():
    base = small_gpt().cuda()
    idx, tgt = (t.cuda() for t in batch(0, seq=16, b=64))

    def run(model, handle=None):
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        _, loss = model(idx, tgt)
        torch.cuda.synchronize()
        if handle is not None:
            handle.store.finish_forward()  # every copy is complete: let the device copies go
        held = torch.cuda.memory_allocated() - start
        loss.backward()
        return held, [p.grad.clone() for p in model.parameters()]

    ref_held, ref_grads = run(copy.deepcopy(base))
    model = copy.deepcopy(base)
    with fuyou.offload_activations(model, plan="host", min_bytes=0, verbose=False) as h:
        held, grads = run(model, h)
        assert h.store.traffic.bytes_moved_out > 0
    for a, b in zip(ref_grads, grads):
        assert torch.equal(a, b)
    assert held < ref_held  # measured by the allocator, not by the hooks


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA device: pinned host staging before the spill")
def test_cuda_ssd_tier_is_bit_identical(daemon):
    base = small_gpt().cuda()
    idx, tgt = (t.cuda() for t in batch(0, seq=16, b=64))

    def run(model):
        _, loss = model(idx, tgt)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    ref = run(copy.deepcopy(base))
    model = copy.deepcopy(base)
    with fuyou.offload_activations(model, plan=SSD, host_budget=0, min_bytes=0,
                                   ssd=daemon.address, verbose=False) as h:
        grads = run(model)
    assert h.store.ssd.stats.bytes_spilled > 0 and h.store.ssd.stats.failed_spills == 0
    for a, b in zip(ref, grads):
        assert torch.equal(a, b)


class _SeqBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class _SeqLoss(nn.Module):
    """A GPT-shaped nn.Sequential (no nn.ModuleList): embedding, 4 blocks, head."""

    def __init__(self, vocab=256, d=32):
        super().__init__()
        self.seq = nn.Sequential(nn.Embedding(vocab, d), *[_SeqBlock(d) for _ in range(4)],
                                 nn.LayerNorm(d), nn.Linear(d, vocab))

    def forward(self, idx, targets):
        logits = self.seq(idx)
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def test_finds_the_blocks_of_an_nn_sequential_and_is_bit_identical():
    torch.manual_seed(0)
    base = _SeqLoss()
    ref = train(copy.deepcopy(base))
    model = copy.deepcopy(base)
    with fuyou.offload_activations(model, plan="host", min_bytes=0, verbose=False) as h:
        assert h.chosen.names == [f"seq.{i}" for i in range(1, 5)]
        got = train(model)
        assert h.store.traffic.bytes_moved_out > 0
    assert_identical(ref, got)
