"""accelerate on its own (issue 34, item 2): ``Accelerator().prepare(model,
optimizer, dataloader, scheduler)`` with a ``fuyou.AdamW``,
``accelerator.accumulate``, ``accelerator.backward``,
``accelerator.clip_grad_norm_`` and ``save_state``/``load_state`` into a new
Accelerator, model and optimizer (the same job), against the same loop with
``torch.optim.AdamW``: every weight after every optimizer step within
``1e-6 + 1e-5 |b|``, resident and streamed."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

import fuyou  # noqa: E402
from test_hf_trainer import ATOL, BETAS, EPS, LR, RTOL, WD, Tokens, tiny  # noqa: E402

MICRO = 2  # micro-batches an optimizer step
_jobs = itertools.count()


def _loop(make_optimizer, micro_batches, state_in=None, state_out=None, save_after=None):
    """The accelerate loop over `micro_batches` micro-batches: weights after each
    optimizer step. `state_in`: load_state from it first; `state_out` with
    `save_after`: save_state there after that many optimizer steps."""
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=MICRO)
    model = tiny("llama")
    opt, closers = make_optimizer(model)
    sched = transformers.get_cosine_schedule_with_warmup(opt, 1, 8)
    data = torch.utils.data.DataLoader(Tokens(n=16), batch_size=2, shuffle=False)
    model, opt, data, sched = accelerator.prepare(model, opt, data, sched)
    if state_in is not None:
        accelerator.load_state(state_in)
    weights = []
    try:
        for i, batch in enumerate(itertools.islice(data, micro_batches)):
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                sched.step()
                opt.zero_grad()
            if accelerator.sync_gradients:
                weights.append([t.detach().clone() for t in model.state_dict().values()])
                if save_after is not None and len(weights) == save_after:
                    accelerator.save_state(state_out)
    finally:
        for c in reversed(closers):
            c.close()
    return weights


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
def test_accelerate_loop_with_save_and_load_state_matches_torch(daemon, streamed, tmp_path):
    job = f"acc-{os.getpid()}-{next(_jobs)}"

    def torch_adamw(model):
        return torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                 weight_decay=WD), []

    def fuyou_adamw(model):
        opt = fuyou.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                          address=daemon.address, job=job, chunk_bytes=8 << 10,
                          offload_params=streamed)
        closers = [opt]
        if streamed:
            closers.append(fuyou.stream_parameters(model, opt, device_budget="64KiB"))
        return opt, closers

    runs = {}
    for name, make in (("torch", torch_adamw), ("fuyou", fuyou_adamw)):
        first = _loop(make, 2 * MICRO, state_out=tmp_path / name, save_after=2)
        # a new Accelerator, model and optimizer: load_state, then two more steps
        again = _loop(make, 2 * MICRO, state_in=tmp_path / name)
        runs[name] = first + again
    assert len(runs["fuyou"]) == len(runs["torch"]) == 4
    for step, (a, b) in enumerate(zip(runs["fuyou"], runs["torch"])):
        for i, (x, y) in enumerate(zip(a, b)):
            assert bool(((x - y).abs() <= ATOL + RTOL * y.abs()).all()), (
                f"step {step}: tensor {i} differs by {float((x - y).abs().max())}")
