"""safetensors and the Hugging Face layout, both ways (issue 34, item 3).

- ``fuyou.export_checkpoint(opt, dir, model, shard_bytes=)`` writes
  ``model.safetensors.index.json`` and ``model-0000i-of-0000n.safetensors``
  shards (and ``config.json``) that ``AutoModelForCausalLM.from_pretrained``
  loads, tensor for tensor the job's weights; the optimizer's moments go to
  ``optimizer-*.safetensors`` beside them, and the whole comes back into a new
  job by ``fuyou.materialize(model, opt, checkpoint=dir)``.
- ``model.save_pretrained(dir)`` of a streamed model writes its trained
  weights (fetched from fuyoud) as safetensors.
- A sharded safetensors checkpoint that ``save_pretrained`` wrote loads into an
  ``init_empty`` model with its weights in fuyoud, one shard at a time, and
  trains from there as torch's AdamW does from ``from_pretrained``; the peak
  host memory of that load is measured in a process of its own.

Models are built from configs with random weights: nothing is downloaded.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

import fuyou  # noqa: E402

ATOL, RTOL = 1e-6, 1e-5
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
_jobs = itertools.count()


def config(tied: bool, width: int = 64, layers: int = 2, intermediate: int = 128,
           vocab: int = 64):
    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32, tie_word_embeddings=tied)


def llama(tied: bool, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config(tied))


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(100 + step))


def train(model, opt, steps: int, first: int = 0):
    """`steps` optimizer steps; the weights (state_dict: a streamed model's come
    from fuyoud) after each."""
    after = []
    for step in range(first, first + steps):
        x = batch(step)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        after.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return after


def assert_close(got: dict, ref: dict, what: str):
    assert set(got) == set(ref), what
    for k, y in ref.items():
        x = got[k]
        assert x.shape == y.shape and bool(((x - y).abs() <= ATOL + RTOL * y.abs()).all()), (
            f"{what}: {k} differs by {float((x - y).abs().max())}")


def assert_equal(got: dict, ref: dict, what: str):
    assert set(got) == set(ref), what
    for k, y in ref.items():
        assert torch.equal(got[k], y), f"{what}: {k}"


def fuyou_adamw(daemon, model, streamed: bool, job=None, **kw):
    """fuyou.AdamW (and, streamed, its stream handle): (optimizer, things to close)."""
    opt = fuyou.AdamW(model.parameters(), address=daemon.address, chunk_bytes=8 << 10,
                      job=job or f"hf-st-{os.getpid()}-{next(_jobs)}", offload_params=streamed,
                      **HYPER, **kw)
    closers = [opt]
    if streamed:
        closers.append(fuyou.stream_parameters(model, opt, device_budget="64KiB"))
    return opt, closers


def close(closers):
    for c in reversed(closers):
        c.close()


def files(directory: Path, index: str) -> dict:
    """Every tensor of a safetensors checkpoint's index, by key, each shard
    checked to carry the metadata transformers reads."""
    weight_map = json.loads((directory / index).read_text())["weight_map"]
    out = {}
    for shard in sorted(set(weight_map.values())):
        assert shard.endswith(".safetensors")
        with safetensors.safe_open(str(directory / shard), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            out.update({k: f.get_tensor(k) for k in f.keys()})
    assert set(out) == set(weight_map)
    return out


# ------------------------------------------------------------------ export_checkpoint
@pytest.mark.parametrize("streamed,tied", [(False, False), (True, True)],
                         ids=["resident-untied", "streamed-tied"])
def test_export_checkpoint_is_what_from_pretrained_loads(daemon, tmp_path, streamed, tied):
    """Trained 3 steps, exported in shards of 32 KiB: from_pretrained gives the
    job's fp32 weights tensor for tensor (torch's AdamW's within tolerance); the
    export materialized into a new streamed job (weights and moments) exports
    again bit for bit."""
    ref_model = llama(tied)
    ref = train(ref_model, torch.optim.AdamW(ref_model.parameters(), **HYPER), 3)[-1]
    model = llama(tied)
    opt, closers = fuyou_adamw(daemon, model, streamed)
    try:
        trained = train(model, opt, 3)[-1]
        assert_close(trained, ref, "fuyou against torch")
        out = tmp_path / "export"
        fuyou.export_checkpoint(opt, out, model, shard_bytes=32 << 10)
    finally:
        close(closers)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    assert not list(out.glob("*.bin"))
    assert ("lm_head.weight" in index["weight_map"]) == (not tied)  # a tie is written once

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is transformers.LlamaForCausalLM
    assert_equal(loaded.state_dict(), trained, "from_pretrained of the export")

    # Back into a new job, streamed: weights and optimizer states, one shard at a time.
    with fuyou.init_empty():
        again = transformers.LlamaForCausalLM(config(tied))
    opt2 = fuyou.AdamW(again.parameters(), address=daemon.address, chunk_bytes=8 << 10,
                       job=f"hf-st-again-{os.getpid()}-{next(_jobs)}", offload_params=True,
                       **HYPER)
    try:
        fuyou.materialize(again, opt2, checkpoint=out)
        second = tmp_path / "second"
        fuyou.export_checkpoint(opt2, second, again, shard_bytes=32 << 10)
    finally:
        opt2.close()
    for index_name in ("model.safetensors.index.json", "optimizer.safetensors.index.json"):
        assert_equal(files(second, index_name), files(out, index_name), index_name)


# ------------------------------------------------------------------ save_pretrained
def test_save_pretrained_of_a_streamed_model_writes_the_trained_weights(daemon, tmp_path):
    """The weights live in fuyoud and the modules hold placeholders; save_pretrained
    writes model.safetensors with the trained weights (torch's AdamW's within
    tolerance, not the initial ones), the tie once."""
    ref_model = llama(tied=True)
    initial = {k: v.clone() for k, v in ref_model.state_dict().items()}
    ref = train(ref_model, torch.optim.AdamW(ref_model.parameters(), **HYPER), 2)[-1]
    model = llama(tied=True)
    opt, closers = fuyou_adamw(daemon, model, streamed=True)
    try:
        trained = train(model, opt, 2)[-1]
        assert all(p.numel() == 0 for p in model.parameters())  # placeholders
        model.save_pretrained(tmp_path / "saved")
    finally:
        close(closers)
    assert (tmp_path / "saved" / "model.safetensors").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    got = loaded.state_dict()
    assert_equal(got, trained, "save_pretrained of the streamed model")
    assert_close(got, ref, "save_pretrained against torch")
    assert not torch.equal(got["model.layers.0.mlp.up_proj.weight"],
                           initial["model.layers.0.mlp.up_proj.weight"])


# ------------------------------------------------------------------ sharded load
def test_hf_sharded_checkpoint_loads_into_a_streamed_model_and_trains_like_torch(daemon,
                                                                                 tmp_path):
    """save_pretrained(max_shard_size=) of a model, materialized into an
    init_empty model whose weights go to fuyoud shard by shard, then trained
    streamed: every weight after every step as torch's AdamW on the model that
    from_pretrained loads from the same files."""
    llama(tied=False).save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) >= 3
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    initial = {k: v.clone() for k, v in ref_model.state_dict().items()}
    ref = train(ref_model, torch.optim.AdamW(ref_model.parameters(), **HYPER), 3)

    with fuyou.init_empty():
        model = transformers.LlamaForCausalLM(
            transformers.AutoConfig.from_pretrained(tmp_path / "hf"))
    opt = fuyou.AdamW(model.parameters(), address=daemon.address, chunk_bytes=8 << 10,
                      job=f"hf-st-load-{os.getpid()}-{next(_jobs)}", offload_params=True,
                      **HYPER)
    closers = [opt]
    try:
        fuyou.materialize(model, opt, checkpoint=tmp_path / "hf")
        closers.append(fuyou.stream_parameters(model, opt, device_budget="64KiB"))
        assert_equal({k: v.detach().clone() for k, v in model.state_dict().items()}, initial,
                     "materialized")
        got = train(model, opt, 3)
    finally:
        close(closers)
    for step, (a, b) in enumerate(zip(got, ref)):
        assert_close(a, b, f"step {step}")


# ------------------------------------------------------------------ peak host memory
LOAD_CONFIG = dict(width=512, layers=4, intermediate=1024, vocab=256)  # 37 MiB of fp32
LOAD_SHARD = 4 << 20


def _load_in_a_process_of_its_own(directory: str, address: str) -> None:
    """``python test_hf_safetensors.py DIR ADDRESS``: materializes the checkpoint
    in DIR into an init_empty Llama streamed to fuyoud and prints, as a JSON line,
    how far the load raised the peak RSS (VmHWM, reset first) above the RSS
    before it, and the model's and its largest module's sizes."""
    sys.path.insert(0, str(Path(__file__).parent))
    from materialize_worker import Phase

    torch.set_num_threads(1)
    with fuyou.init_empty():
        model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(directory))
    opt = fuyou.AdamW(model.parameters(), address=address, job=f"hf-st-rss-{os.getpid()}",
                      offload_params=True, timeout=120.0, **HYPER)
    out = {"model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
           "largest_module_bytes": max(
               sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
               for m in model.modules())}
    try:
        with Phase() as phase:
            fuyou.materialize(model, opt, checkpoint=directory)
        out["growth"] = phase.growth
    finally:
        opt.close()
    print(json.dumps(out), flush=True)


@pytest.mark.slow
def test_sharded_load_holds_about_one_shard(daemon, tmp_path):
    """A 37 MiB checkpoint in 4 MiB safetensors shards (save_pretrained's),
    loaded into an init_empty model streamed to fuyoud, in a fresh process: the
    load raises the process's peak RSS by at most one shard (its mapped pages)
    and two of the largest modules (the module being filled and the tensor
    copied out of the file) and 8 MiB for the allocator, far below the model."""
    cfg = config(tied=False, **LOAD_CONFIG)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "big",
                                                       max_shard_size=LOAD_SHARD)
    shards = list((tmp_path / "big").glob("model-*.safetensors"))
    assert len(shards) >= 8
    shard = max(s.stat().st_size for s in shards)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[2] / "python_client"), str(Path(__file__).parent)]))
    done = subprocess.run([sys.executable, __file__, str(tmp_path / "big"), daemon.address],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    print(figures, "shard", shard)
    model, module = figures["model_bytes"], figures["largest_module_bytes"]
    bound = shard + 2 * module + (8 << 20)
    assert model >= 32 << 20 and bound < model / 2
    assert figures["growth"] < bound, (
        f"the load raised the peak RSS by {figures['growth'] >> 20} MiB (bound {bound >> 20} MiB,"
        f" shard {shard >> 20} MiB, model {model >> 20} MiB)")


if __name__ == "__main__":
    _load_in_a_process_of_its_own(*sys.argv[1:])
