"""fuyou.AdamW(state_dtype="bf16"): Adam's moments kept in bf16 by the daemon
(issue 22 item 4), on a real fuyoud.

- training the tiny GPT on a learnable pattern tracks torch.optim.AdamW (fp32):
  the held-out loss after 40 steps within 2% of torch's (bf16 moments round m to 2^-9 relative
  per step; fp32 states agree to 1e-5, test_parity.py);
- the daemon really stores bf16: every exported moment is a bf16 value, and
  state_dict() still gives fp32 tensors;
- load_state_dict of fp32 moments into a bf16 job rounds them to nearest even;
- a resume with another state_dtype than the job's is refused at once, naming
  the job's; the same one resumes;
- export_checkpoint / init_from and the streamed mode (offload_params) with bf16
  moments.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fuyou
from helpers import SEQ, VOCAB, clone_model, make_model
from test_stream_parameters import BETAS, EPS, LR, WD, offload_adamw, stream_backend  # noqa: F401
from test_stream_parameters import CHUNK_BYTES as STREAM_CHUNK_BYTES
from train_util import CHUNK_BYTES, StreamGPT, split_groups, stream_batch

STEPS = 40
HELD_OUT = range(10_000, 10_004)  # batches no step trained on
LOSS_RTOL = 0.02


def _pattern_loss(model, step: int):
    """A learnable task: each row counts up by a stride of its own (1 or 2)
    from a random start, so the next token follows from the last two."""
    g = torch.Generator().manual_seed(7 * 100003 + step)
    start = torch.randint(0, VOCAB, (8, 1), generator=g)
    stride = torch.randint(1, 3, (8, 1), generator=g)
    data = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return model(data[:, :-1], data[:, 1:])


def _held_out_loss(model) -> float:
    with torch.no_grad():
        return sum(float(_pattern_loss(model, s)) for s in HELD_OUT) / len(HELD_OUT)


def _train(model, opt, steps):
    for step in range(steps):
        _pattern_loss(model, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _moments(opt):
    sd = opt.state_dict()
    return [t for state in sd["state"].values() for k, t in state.items() if k in ("exp_avg", "exp_avg_sq")]


def _is_bf16(t: torch.Tensor) -> bool:
    return torch.equal(t, t.to(torch.bfloat16).to(torch.float32))


def _adamw(daemon, params, job, **kw):
    return fuyou.AdamW(params, lr=1e-3, betas=(0.9, 0.999), job=job, address=daemon.address,
                       chunk_bytes=CHUNK_BYTES, timeout=20.0, **kw)


def test_bf16_moments_train_like_torch_adamw(daemon):
    ref = make_model()
    model = clone_model(ref)
    ref_opt = torch.optim.AdamW(split_groups(ref, lr=3e-3, lr_no_decay=3e-3), lr=3e-3, betas=(0.9, 0.999))
    opt = _adamw(daemon, split_groups(model, lr=3e-3, lr_no_decay=3e-3), "bf16-train", state_dtype="bf16")
    assert opt.state_dtype == "bf16"
    before = _held_out_loss(model)
    _train(ref, ref_opt, STEPS)
    _train(model, opt, STEPS)
    ref_loss, loss = _held_out_loss(ref), _held_out_loss(model)
    print(f"held-out loss: start {before:.4f}, torch fp32 {ref_loss:.4f}, fuyou bf16 states {loss:.4f} "
          f"({(loss - ref_loss) / ref_loss:+.2%})")
    assert loss < 0.8 * before  # it learned
    assert loss == pytest.approx(ref_loss, rel=LOSS_RTOL)
    moments = _moments(opt)
    assert moments and all(t.dtype == torch.float32 for t in moments)
    assert all(_is_bf16(t) for t in moments)
    assert any(bool((t != 0).any()) for t in moments)
    opt.close()


def test_fp32_is_the_default_and_keeps_fp32_moments(daemon):
    model = make_model()
    opt = _adamw(daemon, split_groups(model), "fp32-default")
    assert opt.state_dtype == "fp32"
    _train(model, opt, 3)
    assert not all(_is_bf16(t) for t in _moments(opt))
    opt.close()


def test_load_state_dict_of_fp32_moments_rounds_them(daemon):
    model = make_model()
    source = _adamw(daemon, split_groups(model), "bf16-import-src")
    _train(model, source, 3)
    sd = source.state_dict()
    source.close()
    target = _adamw(daemon, split_groups(clone_model(model)), "bf16-import-dst", state_dtype="bf16")
    target.load_state_dict(sd)
    got = target.state_dict()
    for index, state in sd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            want = state[key].to(torch.bfloat16).to(torch.float32)  # torch rounds to nearest even
            assert torch.equal(got["state"][index][key], want), (index, key)
    target.close()


def test_a_resume_with_another_state_dtype_is_refused(daemon):
    model = make_model()
    opt = _adamw(daemon, split_groups(model), "bf16-resume", state_dtype="bf16")
    _train(model, opt, 2)
    opt.close()
    with pytest.raises(fuyou.FailedPrecondition) as refused:
        _adamw(daemon, split_groups(make_model()), "bf16-resume")  # fp32, the default
    assert "as bfloat16, but this registration asks for float32" in str(refused.value)
    assert 'state_dtype="bf16"' in str(refused.value)
    again = _adamw(daemon, split_groups(make_model()), "bf16-resume", state_dtype=torch.bfloat16)
    assert again.resumed and again.committed_step == 2
    again.close()


@pytest.mark.parametrize("bad", ["fp16", torch.float16, None, 2])
def test_other_state_dtypes_are_refused(bad):
    with pytest.raises(ValueError, match="state_dtype must be"):
        fuyou.AdamW([torch.nn.Parameter(torch.zeros(4))], job="never", state_dtype=bad)


def test_export_checkpoint_and_init_from_keep_bf16_moments(daemon, tmp_path):
    model = make_model()
    opt = _adamw(daemon, split_groups(model), "bf16-export", state_dtype="bf16")
    _train(model, opt, 3)
    ckpt = opt.export_checkpoint(tmp_path / "ckpt.pt", model=model)
    exported = [t for st in ckpt["optimizer"]["state"].values() for k, t in st.items()
                if k in ("exp_avg", "exp_avg_sq")]
    assert exported and all(t.dtype == torch.float32 and _is_bf16(t) for t in exported)
    before = _moments(opt)
    opt.close()
    again = _adamw(daemon, split_groups(clone_model(model)), "bf16-export-2", state_dtype="bf16",
                   init_from=str(tmp_path / "ckpt.pt"))
    assert all(torch.equal(a, b) for a, b in zip(_moments(again), before))
    again.close()


def test_streamed_bf16_moments_train_like_the_resident_run(stream_backend):
    """offload_params (the chunk stores its working weights after master|m|v,
    8 bytes an element here) with bf16 moments tracks a resident run with bf16
    moments. Not bit for bit: v's stochastic rounding is keyed by the element's
    place in its chunk, and the streamed mode chunks by module. A step's update
    (at most ~lr) differs by up to ~2^-7 of itself where v or m rounds the other
    way: over 3 steps 3 * lr * 2^-7 = 7e-5, so each weight within 1e-4 of the
    resident one (the weights moved by more than 5e-3)."""
    torch.manual_seed(0)
    model = StreamGPT(n_layer=2)
    start = copy.deepcopy(model)
    resident = copy.deepcopy(model)
    res_opt = stream_backend.adamw(resident.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                   weight_decay=WD, chunk_bytes=STREAM_CHUNK_BYTES, state_dtype="bf16")
    opt = offload_adamw(stream_backend, model.parameters(), state_dtype="bf16")
    handle = fuyou.stream_parameters(model, opt, device_budget="16KiB")
    try:
        for step in range(3):
            for m, o in ((resident, res_opt), (model, opt)):
                m(*stream_batch(step)).backward()
                o.step()
                o.zero_grad()
        got = opt.export_checkpoint()["model"]
        want = res_opt.export_checkpoint()["model"]
        moved = max(float((want[i] - p.detach()).abs().max()) for i, p in enumerate(start.parameters()))
        assert moved > 5e-3
        for i in want:
            assert float((got[i] - want[i]).abs().max()) <= 1e-4, f"parameter {i}"
        assert all(_is_bf16(t) for t in _moments(opt)) or stream_backend.name == "fake"
    finally:
        handle.close()
        opt.close()
        res_opt.close()
