#!/usr/bin/env python3
"""GPU tests of the chunk pipeline (issue 11). Each skips with a clear message
where no CUDA device (or no fuyoud / binding) is available.

    FUYOU_DAEMON=$PWD/build/daemon/fuyoud PYTHONPATH=$PWD/python_client \\
        python3 -m pytest -q tests/gpu/test_cuda_pipeline.py
or without pytest (the GPU machine may lack it):
        python3 tests/gpu/test_cuda_pipeline.py

1. fuyou against torch.optim.AdamW on CUDA, fp32, bf16 and fp16 with a loss
   scale, 2 slots (so chunks are staged in device memory during backward): after
   every step, the model's weights equal AdamW applied on the GPU to fp32
   masters with the same gradients, rounded to the parameter's dtype.
2. The session's slots are pinned: torch's is_pinned (cudaPointerGetAttributes
   type == cudaMemoryTypeHost) on every slot region.
3. No host-blocking copy in the hook: backward of a model with many chunks
   under torch.cuda.set_sync_debug_mode("error") (a synchronising call raises).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "python_client") not in sys.path:
    sys.path.insert(0, str(REPO / "python_client"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fuyou  # noqa: E402

try:
    import pytest
except ImportError:  # run as a script
    pytest = None

NO_GPU = "no CUDA device: the GPU tests of issue 11 need one (deploy/gpu-check.sh on a GPU machine)"
CHUNK_BYTES = 64 << 10
LR, BETAS, WD = 1e-3, (0.9, 0.999), 0.01


class Skip(Exception):
    pass


def _skip(why):
    if pytest is not None:
        pytest.skip(why)
    raise Skip(why)


def _daemon(tmp):
    if not torch.cuda.is_available():
        _skip(NO_GPU)
    binary = os.environ.get("FUYOU_DAEMON") or next(
        (str(p) for p in sorted(REPO.glob("build*/daemon/fuyoud"))), None)
    if binary is None or not os.access(binary, os.X_OK):
        _skip("fuyoud not found (set FUYOU_DAEMON)")
    try:
        import fuyou._fuyou  # noqa: F401
    except ImportError as e:
        _skip(f"fuyou._fuyou binding does not load: {e}")
    return fuyou.EmbeddedDaemon(data_dir=str(Path(tmp) / "data"),
                                socket_path=str(Path(tmp) / "d.sock"),
                                extra_args=["--dram-budget", "512MiB"], binary=binary)


class Net(nn.Module):
    def __init__(self, vocab=512, dim=128, layers=4):
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                          nn.Linear(4 * dim, dim)) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for b in self.blocks:
            x = x + b(x)
        return F.cross_entropy(self.head(x).float().reshape(-1, self.vocab), targets.reshape(-1))


def _data(step, device):
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, 512, (8, 64), generator=g)
    return idx.to(device), torch.roll(idx, -1, 1).to(device)


def _parity(dtype, loss_scale=None, steps=6):
    dev = torch.device("cuda")
    with tempfile.TemporaryDirectory(prefix="fuyou-gpu-") as tmp, _daemon(tmp) as d:
        torch.manual_seed(0)
        model = Net().to(dev, dtype)
        masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
        ref = torch.optim.AdamW(masters, lr=LR, betas=BETAS, weight_decay=WD, foreach=False)
        opt = fuyou.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD,
                          job=f"parity-{str(dtype)[6:]}", address=d.address,
                          chunk_bytes=CHUNK_BYTES, num_slots=2, loss_scale=loss_scale,
                          timeout=60.0)
        assert opt.num_chunks > 4, opt.num_chunks
        rtol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
        atol = {torch.float32: 1e-6, torch.bfloat16: 1e-5, torch.float16: 1e-6}[dtype]
        try:
            for step in range(steps):
                loss = model(*_data(step, dev))
                opt.scale_loss(loss).backward()
                for m, p in zip(masters, model.parameters()):
                    m.grad = p.grad.float() / opt.loss_scale
                opt.step()
                ref.step()
                opt.zero_grad()
                torch.cuda.synchronize()
                for i, (m, p) in enumerate(zip(masters, model.parameters())):
                    want = m.detach().to(dtype).float()
                    err = (p.detach().float() - want).abs()
                    ok = bool((err <= atol + rtol * want.abs()).all())
                    assert ok, (f"{dtype} step {step} param {i}: max |fuyou - torch| = "
                                f"{err.max().item():.3g}")
            assert opt.committed_step == steps
            assert opt.loop_stats.speculative_updates > 0
        finally:
            opt.close()


def test_parity_fp32():
    _parity(torch.float32)


def test_parity_bf16():
    _parity(torch.bfloat16)


def test_parity_fp16_with_loss_scale():
    _parity(torch.float16, loss_scale=1024.0)


def test_slots_are_pinned():
    with tempfile.TemporaryDirectory(prefix="fuyou-gpu-") as tmp, _daemon(tmp) as d:
        model = Net().cuda()
        opt = fuyou.AdamW(model.parameters(), job="pinned", address=d.address,
                          chunk_bytes=CHUNK_BYTES, num_slots=3)
        try:
            dev = opt.pipeline.slots.device
            assert dev.streams, "parameters on CUDA must take the CUDA path"
            assert dev.pinned, f"slots not registered: {dev.pin_error}"
            session = opt.pipeline.session
            for slot in range(session.num_slots):
                for region in (session.grad_region(slot), session.param_region(slot)):
                    t = torch.frombuffer(region, dtype=torch.uint8)
                    assert t.is_pinned(), f"slot {slot} region at {t.data_ptr():#x} is not pinned"
        finally:
            opt.close()


def test_no_host_synchronisation_in_backward():
    with tempfile.TemporaryDirectory(prefix="fuyou-gpu-") as tmp, _daemon(tmp) as d:
        model = Net(layers=8).cuda()
        opt = fuyou.AdamW(model.parameters(), job="nosync", address=d.address,
                          chunk_bytes=CHUNK_BYTES, num_slots=64)
        try:
            assert opt.num_chunks >= 8
            for step in range(3):
                loss = model(*_data(step, "cuda"))
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    loss.backward()  # a synchronising call in a hook raises here
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                opt.pipeline.wait_sent()
                assert len(opt.pipeline.step.sent_chunks()) == opt.num_chunks
                opt.step()
                opt.zero_grad()
            assert opt.committed_step == 3
        finally:
            opt.close()


if __name__ == "__main__":
    pytest = None  # skips are reported by the loop below
    failed = 0
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            try:
                fn()
                print(f"PASS {name}")
            except Skip as e:
                print(f"SKIP {name}: {e}")
            except Exception as e:  # noqa: BLE001
                failed += 1
                print(f"FAIL {name}: {type(e).__name__}: {e}")
    sys.exit(1 if failed else 0)
