"""fuyou.AdamW(state_dtype="bf16") and state_dtype="8bit": Adam's moments kept
in bf16 (issue 22 item 4) or as 8-bit codes with a scale per block of 256
(issue 36 item 1) by the daemon, on a real fuyoud. Each test runs for both
where both apply.

- training the tiny GPT on a learnable pattern tracks torch.optim.AdamW (fp32):
  the held-out loss after 40 steps within 2% of torch's (bf16 moments round m to 2^-9 relative
  per step, 8-bit ones to 2^-4; fp32 states agree to 1e-5, test_parity.py);
- the daemon really stores them: every exported bf16 moment is a bf16 value;
  8-bit moments hold few distinct values (at most 256 a block); state_dict()
  still gives fp32 tensors;
- load_state_dict of fp32 moments rounds them (bf16: to nearest even; 8-bit:
  within one code step), and loading what was exported gives the same bits;
- a resume with another state_dtype than the job's is refused at once, naming
  the job's; the same one resumes;
- export_checkpoint / init_from and the streamed mode (offload_params).
"""

from __future__ import annotations

import copy
import math

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


# The ratios of two 8-bit codes' values, (16 + f1) / (16 + f2) (4-bit mantissas f),
# brought into [1, 2): in one block, x1 / x2 is one of them times a power of 2.
_CODE_RATIOS = torch.tensor(sorted({(r / 2 ** math.floor(math.log2(r))) for r in
                                    ((16 + a) / (16 + b) for a in range(16) for b in range(16))}),
                            dtype=torch.float64)


def _is_8bit(t: torch.Tensor) -> bool:
    """Nearly all neighbours (both nonzero; all but those on either side of a
    block's edge) are in the ratio of two code values: an fp32 pair is, by
    chance, in about 1% of cases."""
    x = t.flatten().double()
    a, b = x[:-1], x[1:]
    both = (a != 0) & (b != 0)
    if int(both.sum()) < 16:
        return False
    r = (a[both] / b[both]).abs()
    r = r / torch.exp2(torch.floor(torch.log2(r)))
    near = (r[:, None] / _CODE_RATIOS[None, :] - 1).abs().amin(dim=1) < 1e-5
    return float(near.double().mean()) > 0.95


def _stored_as(state_dtype: str):
    return _is_bf16 if state_dtype == "bf16" else _is_8bit


DTYPES = ["bf16", "8bit"]


def _adamw(daemon, params, job, **kw):
    return fuyou.AdamW(params, lr=1e-3, betas=(0.9, 0.999), job=job, address=daemon.address,
                       chunk_bytes=CHUNK_BYTES, timeout=20.0, **kw)


@pytest.mark.parametrize("state_dtype", DTYPES)
def test_low_precision_moments_train_like_torch_adamw(daemon, state_dtype):
    ref = make_model()
    model = clone_model(ref)
    ref_opt = torch.optim.AdamW(split_groups(ref, lr=3e-3, lr_no_decay=3e-3), lr=3e-3, betas=(0.9, 0.999))
    opt = _adamw(daemon, split_groups(model, lr=3e-3, lr_no_decay=3e-3), f"{state_dtype}-train",
                 state_dtype=state_dtype)
    assert opt.state_dtype == state_dtype
    before = _held_out_loss(model)
    _train(ref, ref_opt, STEPS)
    _train(model, opt, STEPS)
    ref_loss, loss = _held_out_loss(ref), _held_out_loss(model)
    print(f"held-out loss: start {before:.4f}, torch fp32 {ref_loss:.4f}, fuyou {state_dtype} states {loss:.4f} "
          f"({(loss - ref_loss) / ref_loss:+.2%})")
    assert loss < 0.8 * before  # it learned
    assert loss == pytest.approx(ref_loss, rel=LOSS_RTOL)
    moments = _moments(opt)
    assert moments and all(t.dtype == torch.float32 for t in moments)
    assert all(_stored_as(state_dtype)(t) for t in moments)
    assert any(bool((t != 0).any()) for t in moments)
    opt.close()


def test_fp32_is_the_default_and_keeps_fp32_moments(daemon):
    model = make_model()
    opt = _adamw(daemon, split_groups(model), "fp32-default")
    assert opt.state_dtype == "fp32"
    _train(model, opt, 3)
    assert not all(_is_bf16(t) for t in _moments(opt))
    assert not all(_is_8bit(t) for t in _moments(opt))
    opt.close()


@pytest.mark.parametrize("state_dtype", DTYPES)
def test_load_state_dict_of_fp32_moments_rounds_them(daemon, state_dtype):
    model = make_model()
    source = _adamw(daemon, split_groups(model), f"{state_dtype}-import-src")
    _train(model, source, 3)
    sd = source.state_dict()
    source.close()
    target = _adamw(daemon, split_groups(clone_model(model)), f"{state_dtype}-import-dst", state_dtype=state_dtype)
    target.load_state_dict(sd)
    got = target.state_dict()
    # A block may hold the end of one tensor and the start of the next: the
    # largest of all tensors bounds every block's largest.
    largest = {key: max(float(s[key].abs().max()) for s in sd["state"].values()) for key in ("exp_avg", "exp_avg_sq")}
    for index, state in sd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            have = got["state"][index][key]
            if state_dtype == "bf16":
                want = state[key].to(torch.bfloat16).to(torch.float32)  # torch rounds to nearest even
                assert torch.equal(have, want), (index, key)
                continue
            # Half a code step (m: 2^-4 of the value, v: 2^-5), or below the smallest
            # code, 2^-15 of the largest in the block, stored as 0 (m) or as the
            # smallest code (v).
            want = state[key]
            tol = want.abs() / (16 if key == "exp_avg" else 32) * 1.001 + largest[key] * 2 ** -14
            assert bool(((have - want).abs() <= tol).all()), (index, key)
            if key == "exp_avg_sq":
                assert bool((have[want > 0] > 0).all()), "a nonzero v was stored as zero"
    # What an 8-bit (or bf16) job exports, loaded again, gives the same bits.
    target.load_state_dict(got)
    again = target.state_dict()
    for index, state in got["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(again["state"][index][key], state[key]), (index, key)
    target.close()


@pytest.mark.parametrize("state_dtype,stored,other,spelled", [
    ("bf16", "bfloat16", "8bit", torch.bfloat16), ("8bit", "8-bit blocks", "bf16", "int8")])
def test_a_resume_with_another_state_dtype_is_refused(daemon, state_dtype, stored, other, spelled):
    model = make_model()
    job = f"{state_dtype}-resume"
    opt = _adamw(daemon, split_groups(model), job, state_dtype=state_dtype)
    _train(model, opt, 2)
    opt.close()
    with pytest.raises(fuyou.FailedPrecondition) as refused:
        _adamw(daemon, split_groups(make_model()), job)  # fp32, the default
    assert f"as {stored}, but this registration asks for float32" in str(refused.value)
    assert f'state_dtype="{state_dtype}"' in str(refused.value)
    with pytest.raises(fuyou.FailedPrecondition, match=f"as {stored}, but"):
        _adamw(daemon, split_groups(make_model()), job, state_dtype=other)
    again = _adamw(daemon, split_groups(make_model()), job, state_dtype=spelled)
    assert again.resumed and again.committed_step == 2
    again.close()


@pytest.mark.parametrize("bad", ["fp16", torch.float16, None, 2])
def test_other_state_dtypes_are_refused(bad):
    with pytest.raises(ValueError, match="state_dtype must be"):
        fuyou.AdamW([torch.nn.Parameter(torch.zeros(4))], job="never", state_dtype=bad)


@pytest.mark.parametrize("state_dtype", DTYPES)
def test_export_checkpoint_and_init_from_keep_the_moments(daemon, tmp_path, state_dtype):
    model = make_model()
    opt = _adamw(daemon, split_groups(model), f"{state_dtype}-export", state_dtype=state_dtype)
    _train(model, opt, 3)
    ckpt = opt.export_checkpoint(tmp_path / "ckpt.pt", model=model)
    exported = [t for st in ckpt["optimizer"]["state"].values() for k, t in st.items()
                if k in ("exp_avg", "exp_avg_sq")]
    assert exported and all(t.dtype == torch.float32 and _stored_as(state_dtype)(t) for t in exported)
    before = _moments(opt)
    opt.close()
    again = _adamw(daemon, split_groups(clone_model(model)), f"{state_dtype}-export-2", state_dtype=state_dtype,
                   init_from=str(tmp_path / "ckpt.pt"))
    assert all(torch.equal(a, b) for a, b in zip(_moments(again), before))
    again.close()


@pytest.mark.parametrize("state_dtype,within,mean_within", [("bf16", 1e-4, 1e-4), ("8bit", 3 * LR, 4e-4)])
def test_streamed_moments_train_like_the_resident_run(stream_backend, state_dtype, within, mean_within):
    """offload_params (the chunk stores its working weights after master|m|v)
    with bf16 or 8-bit moments tracks a resident run with the same moments. Not
    bit for bit: v's stochastic rounding is keyed by the element's place in its
    chunk (and 8-bit blocks are cut by it), and the streamed mode chunks by
    module. A step's update (at most ~lr) differs by up to ~2^-7 of itself
    (bf16) where v or m rounds the other way: over 3 steps 3 * lr * 2^-7 =
    7e-5, so each weight within 1e-4 of the resident one. 8-bit codes round m
    to 2^-4 of itself and v to 2^-5, and store a v below 2^-16 of its block's
    largest as the smallest code, so where the two chunkings put an element in
    blocks of other largests its update can differ by more: each weight within
    3 lr, on average within 4e-4 (the weights moved by more than 5e-3)."""
    torch.manual_seed(0)
    model = StreamGPT(n_layer=2)
    start = copy.deepcopy(model)
    resident = copy.deepcopy(model)
    res_opt = stream_backend.adamw(resident.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                   weight_decay=WD, chunk_bytes=STREAM_CHUNK_BYTES, state_dtype=state_dtype)
    opt = offload_adamw(stream_backend, model.parameters(), state_dtype=state_dtype)
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
            assert float((got[i] - want[i]).abs().max()) <= within, f"parameter {i}"
            assert float((got[i] - want[i]).abs().mean()) <= mean_within, f"parameter {i}"
        assert all(_stored_as(state_dtype)(t) for t in _moments(opt)) or stream_backend.name == "fake"
    finally:
        handle.close()
        opt.close()
        res_opt.close()
