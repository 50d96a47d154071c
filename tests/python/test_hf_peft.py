"""PEFT / LoRA with fuyou (issue 34, item 4).

``peft.get_peft_model(model, LoraConfig(...))`` freezes the base and adds the
adapters. With ``fuyou.AdamW(peft_model.parameters(), offload_params=True,
track_frozen=True)`` and ``fuyou.stream_parameters`` the frozen base's weights
live in fuyoud too and stream in module by module, read-only: they are never
sent, never updated, nothing of them is written per step; the adapters train.
Compared, weight for weight after every step (``|a - b| <= 1e-6 + 1e-5 |b|``),
with the same PEFT run with the base resident and ``torch.optim.AdamW`` over
the adapters. ``save_pretrained`` writes the adapter, which
``PeftModel.from_pretrained`` loads onto a fresh base.

Models are built from configs with random weights: nothing is downloaded.
"""

from __future__ import annotations

import itertools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import fuyou  # noqa: E402

ATOL, RTOL = 1e-6, 1e-5
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS = 3
_jobs = itertools.count()


def base_model():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=False))


def lora_model():
    """The base with LoRA adapters on q, v and up (B random too, so that every
    adapter gets a gradient from the first step)."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                             lora_dropout=0.0, init_lora_weights="gaussian")
    model = peft.get_peft_model(base_model(), config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    return model


def train(model, opt, steps=STEPS, each=None):
    """`steps` optimizer steps; the state_dict after each (a streamed model's
    weights come from fuyoud)."""
    after = []
    for step in range(steps):
        x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        after.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        if each is not None:
            each()
    return after


def assert_close(got: dict, ref: dict, what: str):
    assert set(got) == set(ref), what
    for k, y in ref.items():
        x = got[k]
        assert x.shape == y.shape and bool(((x - y).abs() <= ATOL + RTOL * y.abs()).all()), (
            f"{what}: {k} differs by {float((x - y).abs().max())}")


def adapter_state_dict(model) -> dict:
    """The state_dict entries of the modules that own a trainable parameter (the
    adapters), each module's fetched on its own: what ``save_pretrained(dir,
    state_dict=...)`` needs without the base's weights."""
    out = {}
    for name, module in model.named_modules():
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            out.update(module.state_dict(prefix=f"{name}."))
    return out


def reference():
    model = lora_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **HYPER)
    return train(model, opt)


def test_lora_on_a_streamed_read_only_base_matches_the_resident_run(daemon, tmp_path):
    ref = reference()
    model = lora_model()
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    base_numel = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert adapters and sum(p.numel() for p in model.parameters() if p.requires_grad) \
        < base_numel / 10
    opt = fuyou.AdamW(model.parameters(), address=daemon.address, chunk_bytes=8 << 10,
                      job=f"lora-{os.getpid()}-{next(_jobs)}", offload_params=True,
                      track_frozen=True, **HYPER)
    handle = fuyou.stream_parameters(model, opt, device_budget="64KiB")
    written = []

    def stats():
        s = fuyou.admin_stats(daemon.address)
        written.append((int(s["bytes_written"]), opt.offload.weights.fetches))

    try:
        assert all(p.numel() == 0 for p in model.parameters())  # base too: placeholders
        stats()
        got = train(model, opt, each=stats)
        for step, (a, b) in enumerate(zip(got, ref)):
            assert_close(a, b, f"step {step}")  # adapters trained, base as it was
        # Read-only: the base's 16 bytes a parameter of states (master, m, v,
        # weights) are far more than what a step writes (the adapters' states
        # and the commit); its chunks are fetched every step (64 KiB of budget).
        base_chunks = [c for c in opt.pipeline.plan.chunks
                       if not c.segments[0].param.requires_grad]
        assert sum(c.num_elements for c in base_chunks) == base_numel
        for (w0, f0), (w1, f1) in zip(written, written[1:]):
            assert w1 - w0 < 16 * base_numel / 4, (w1 - w0, base_numel)
            assert f1 - f0 >= len(base_chunks), (f1 - f0, len(base_chunks))
        # The optimizer's state: moments and steps for the adapters only.
        names = [n for n, _p in model.named_parameters()]
        state = opt.state_dict()["state"]
        assert {names[i] for i in state} == adapters
        assert all(int(s["step"]) == STEPS for s in state.values())
        model.save_pretrained(tmp_path / "adapter")  # state_dict(): the base fetched too
        # The adapter alone, for a base larger than memory: the state_dict of the
        # modules that own trainable parameters, fetched module by module; the
        # whole model's state_dict is refused under the same limit.
        handle.state_dict_limit_bytes = 16 << 10  # the adapters' 13 KiB, not the base's
        with pytest.raises(fuyou.FailedPrecondition, match="state_dict_limit_bytes"):
            model.state_dict()
        own = adapter_state_dict(model)
        assert set(own) == {k for k in ref[-1] if "lora_" in k}
        model.save_pretrained(tmp_path / "adapter-only", state_dict=own)
    finally:
        handle.close()
        opt.close()

    from safetensors.torch import load_file
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    assert len(saved) == len(adapters)
    alone = load_file(tmp_path / "adapter-only" / "adapter_model.safetensors")
    assert set(alone) == set(saved) and all(torch.equal(alone[k], saved[k]) for k in saved)
    loaded = peft.PeftModel.from_pretrained(base_model(), tmp_path / "adapter")
    assert_close({k: v for k, v in loaded.state_dict().items()}, ref[-1], "adapter loaded")


def test_lora_with_a_resident_base_and_fuyou_adamw_matches_torch(daemon):
    """The base resident, fuyou.AdamW given model.parameters(): the frozen base
    costs nothing (not registered), the adapters train as with torch's."""
    ref = reference()
    model = lora_model()
    opt = fuyou.AdamW(model.parameters(), address=daemon.address, chunk_bytes=8 << 10,
                      job=f"lora-res-{os.getpid()}-{next(_jobs)}", **HYPER)
    try:
        assert {id(p) for p in opt.pipeline.params} == {
            id(p) for p in model.parameters() if p.requires_grad}
        for step, (a, b) in enumerate(zip(train(model, opt), ref)):
            assert_close(a, b, f"step {step}")
    finally:
        opt.close()


def test_unfreezing_a_parameter_streamed_read_only_is_refused(daemon):
    model = lora_model()
    opt = fuyou.AdamW(model.parameters(), address=daemon.address, chunk_bytes=8 << 10,
                      job=f"lora-unfreeze-{os.getpid()}-{next(_jobs)}", offload_params=True,
                      track_frozen=True, **HYPER)
    handle = fuyou.stream_parameters(model, opt, device_budget="64KiB")
    try:
        train(model, opt, steps=1)
        down = model.base_model.model.model.layers[0].mlp.down_proj.weight
        down.requires_grad_(True)
        x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))
        model(input_ids=x, labels=x).loss.backward()
        with pytest.raises(fuyou.FailedPrecondition, match="track_frozen=True streams such "
                                                           "parameters read-only"):
            opt.step()
        assert opt.committed_step == 1
    finally:
        handle.close()
        opt.close()
