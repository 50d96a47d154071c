"""init_empty, materialize and sharded checkpoints (issue 12, deliverable 3)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

import fuyou
from fuyou import _materialize
from helpers import TinyGPT, assert_models_close, make_model
from train_util import CHUNK_BYTES, StreamGPT, split_groups, step_loss, stream_batch

REPO = Path(__file__).resolve().parents[2]
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)


def _train(model, opt, first, count):
    for step in range(first, first + count):
        step_loss(model, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _normal_init(module):
    """Every own parameter ~ N(0, 0.02) from torch's global generator, in order."""
    for p in module.parameters(recurse=False):
        p.normal_(0.0, 0.02)


def _reference_init(model, init, seed):
    """What materialize(init=) does, on a model built normally: init each module
    in model.modules() order whose parameters no earlier module holds (ties)."""
    torch.manual_seed(seed)
    seen = set()
    with torch.no_grad():
        for m in model.modules():
            own = [p for p in m.parameters(recurse=False) if id(p) not in seen]
            if own:
                init(m)
                seen.update(id(p) for p in own)
    return model


def _run_python(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'python_client'}:{REPO / 'tests' / 'python'}")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


# --------------------------------------------------------------------- init_empty
def test_init_empty_builds_on_meta_and_holds_no_memory():
    with fuyou.init_empty(job="empty-job"):
        model = TinyGPT()
        assert all(p.is_meta for p in model.parameters())
    assert model.head.weight is model.tok.weight  # the tie survives the swap
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and _materialize.is_empty(p), name
        assert p.storage().size() <= 1, name  # one element seen through zero strides
        assert p.requires_grad
    assert _materialize.job_of(model.parameters()) == "empty-job"
    assert model.blocks[0].fc.weight.shape == (4 * 32, 32)


def test_init_empty_of_a_large_model_allocates_nothing():
    """1 GiB of fp32 parameters built in init_empty: the process's peak RSS grows
    by a few MiB at most (measured in a fresh interpreter)."""
    out = _run_python("""
        import torch, torch.nn as nn, fuyou
        def hwm():
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        base = hwm()
        with fuyou.init_empty():
            model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(16)])
        size = sum(p.numel() * 4 for p in model.parameters())
        print(size, hwm() - base)
    """)
    size, grew = map(int, out.split())
    assert size >= 1 << 30
    assert grew < 32 << 20, f"init_empty of {size >> 20} MiB grew the peak RSS by {grew >> 20} MiB"


def test_materialize_without_optimizer_matches_a_normal_build():
    torch.manual_seed(3)
    ref = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    with fuyou.init_empty():
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    torch.manual_seed(3)  # reset_parameters draws in the order the constructors did
    fuyou.materialize(model)
    assert_models_close(model, ref, rtol=0, atol=0, what="reset_parameters")
    assert not any(_materialize.is_empty(p) for p in model.parameters())

    ref = _reference_init(make_model(seed=0), _normal_init, seed=5)
    with fuyou.init_empty():
        gpt = TinyGPT()
    torch.manual_seed(5)
    fuyou.materialize(gpt, init=_normal_init)
    assert gpt.head.weight is gpt.tok.weight
    assert_models_close(gpt, ref, rtol=0, atol=0, what="init=")


def test_materialize_asks_for_init_when_a_module_has_no_reset_parameters():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))

    with fuyou.init_empty():
        model = nn.Sequential(nn.Linear(4, 4), Custom())
    with pytest.raises(fuyou.InvalidArgument, match=r"'1' \(Custom\).*no reset_parameters"):
        fuyou.materialize(model)


def test_a_tied_parameter_keeps_its_first_owners_values():
    """B's weight is A's (tied) and B has a bias of its own: B's reset_parameters
    runs for its bias, and what it writes into the shared weight is dropped."""
    with fuyou.init_empty():
        model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6))
        model[1].weight = model[0].weight
    torch.manual_seed(2)
    fuyou.materialize(model)
    torch.manual_seed(2)
    a, b = nn.Linear(6, 6), nn.Linear(6, 6)  # the draws of both resets, in order
    assert model[1].weight is model[0].weight
    assert torch.equal(model[0].weight, a.weight) and torch.equal(model[0].bias, a.bias)
    assert torch.equal(model[1].bias, b.bias)


def test_adamw_takes_the_job_init_empty_recorded(fake_backend):
    with fuyou.init_empty(job="recorded-job"):
        model = TinyGPT()
    fuyou.materialize(model)
    opt = fuyou.AdamW(model.parameters(), address=fake_backend.address)
    assert opt.job == "recorded-job"
    opt.close()
    with pytest.raises(ValueError, match=r"fuyou.init_empty\(job=...\)"):
        fuyou.AdamW(make_model().parameters(), address=fake_backend.address)


def test_parameters_without_values_are_never_sent(daemon):
    """An init_empty model is refused by an ordinary fuyou.AdamW, and by
    stream_parameters (which registers every module) before materialize."""
    with fuyou.init_empty(job="mat-unset"):
        model = StreamGPT()
    with pytest.raises(fuyou.InvalidArgument, match="hold no values; fuyou.materialize"):
        fuyou.AdamW(model.parameters(), address=daemon.address)
    opt = fuyou.AdamW(model.parameters(), address=daemon.address, offload_params=True)
    with pytest.raises(fuyou.FailedPrecondition, match="built in fuyou.init_empty.*is new"):
        fuyou.stream_parameters(model, opt)
    opt.close()


# --------------------------------------------------------------------- sharded checkpoints
def _adamw(daemon, params, **kw):
    return fuyou.AdamW(params, address=daemon.address, timeout=20.0, chunk_bytes=CHUNK_BYTES,
                       **HYPER, **kw)


def test_sharded_export_round_trips_bit_exact(daemon, tmp_path):
    model = make_model()
    opt = _adamw(daemon, split_groups(model), job="shard-a")
    _train(model, opt, 0, 4)
    whole = opt.export_checkpoint(model=model)  # the single-file export, for reference
    out = tmp_path / "ckpt"
    summary = fuyou.export_checkpoint(opt, out, model=model, shard_bytes=16 << 10)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and all((out / s).is_file() for s in shards)
    assert "head.weight" not in index["weight_map"]  # tied: once, under its first name
    assert index["metadata"]["fuyou"]["committed_step"] == 4
    # Memory held while writing: about a shard of each kind and a few chunks,
    # far below the model's fp32 weights and moments.
    model_bytes = sum(p.numel() for p in model.parameters()) * 4 * 3
    assert summary["peak_bytes"] < model_bytes / 3
    for s in shards:  # each shard stays near its bound (a larger tensor gets its own)
        for name, t in load_file(out / s).items():
            assert index["weight_map"][name] == s

    # Weights: materialize(checkpoint=) into an empty model, one shard at a time.
    with fuyou.init_empty():
        back = TinyGPT()
    fuyou.materialize(back, checkpoint=out)
    for name, t in back.state_dict().items():
        assert torch.equal(t, whole["model"][name]), name

    # Optimizer states: a new job from the sharded checkpoint, streamed in.
    other = make_model(seed=9)  # its weights are replaced by the checkpoint's masters
    opt2 = _adamw(daemon, split_groups(other, lr=7.0), job="shard-a2", init_from=out)
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert_models_close(other, model, rtol=0, atol=0, what="imported masters")
    again = opt2.export_checkpoint(model=other)
    for i, st in whole["optimizer"]["state"].items():
        got = again["optimizer"]["state"][i]
        assert got["step"] == st["step"]
        assert torch.equal(got["exp_avg"], st["exp_avg"]) and torch.equal(
            got["exp_avg_sq"], st["exp_avg_sq"]), i
    _train(model, opt, 4, 3)
    _train(other, opt2, 4, 3)
    assert_models_close(other, model, rtol=0, atol=0, what="continued")
    opt.close()
    opt2.close()


def test_mismatched_sharded_checkpoint_is_refused(daemon, tmp_path):
    model = make_model()
    opt = _adamw(daemon, split_groups(model), job="shard-b")
    _train(model, opt, 0, 1)
    out = tmp_path / "ckpt"
    fuyou.export_checkpoint(opt, out, model=model, shard_bytes=16 << 10)
    opt.close()

    with fuyou.init_empty():
        wider = TinyGPT(d=48)
    with pytest.raises(fuyou.InvalidArgument, match=r"'tok.weight' has shape \(64, 32\) there, "
                                                    r"\(64, 48\) in the model"):
        fuyou.materialize(wider, checkpoint=out)

    with fuyou.init_empty():
        deeper = TinyGPT(n_layer=3)
    with pytest.raises(fuyou.InvalidArgument, match=r"lacks \d+ of the model's parameters "
                                                    r"\(first: \['blocks.2"):
        fuyou.materialize(deeper, checkpoint=out)

    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["blocks.0.extra"] = index["weight_map"]["tok.weight"]
    index_path.write_text(json.dumps(index))
    with fuyou.init_empty():
        same = TinyGPT()
    with pytest.raises(fuyou.InvalidArgument, match=r"tensors the model does not have "
                                                    r"\(first: \['blocks.0.extra'\]\)"):
        fuyou.materialize(same, checkpoint=out)
    with pytest.raises(fuyou.InvalidArgument, match="parameter groups"):
        _adamw(daemon, model.parameters(), job="shard-b2", init_from=out)
    assert "shard-b2" not in [j["name"] for j in fuyou.admin_client(daemon.address).list_jobs()]


def _hf_checkpoint(model, directory: Path, names_per_shard: int) -> None:
    """A HuggingFace-style sharded checkpoint of `model` written by hand: an index
    without fuyou's metadata (no shapes), shards of a few tensors each."""
    directory.mkdir()
    sd = model.state_dict()
    sd.pop("head.weight")  # tied: HF writes it once
    names = list(sd)
    groups = [names[i:i + names_per_shard] for i in range(0, len(names), names_per_shard)]
    weight_map = {}
    for i, group in enumerate(groups, 1):
        file = f"pytorch_model-{i:05d}-of-{len(groups):05d}.bin"
        torch.save({n: sd[n].clone() for n in group}, directory / file)
        weight_map.update({n: file for n in group})
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))


def test_materialize_holds_one_shard_at_a_time(tmp_path, monkeypatch):
    """A foreign checkpoint of torch's .bin shards (older Hugging Face ones, read,
    never written): shapes are checked by mapping every shard once first, then the weights load in one pass over the shards; a module
    whose weight and bias sit in two shards never has both shards alive."""
    ref = make_model(seed=4)
    _hf_checkpoint(ref, tmp_path / "hf", names_per_shard=3)
    from fuyou import _shard_files
    live, loads, real_load = [], [], torch.load

    def tracked_load(path, **kw):
        shard = real_load(path, **kw)
        name = Path(path).name
        assert not live, f"{name} loaded while {live} is still held"
        live.append(name)
        loads.append(name)
        import weakref
        weakref.finalize(next(iter(shard.values())), live.remove, name)
        return shard

    monkeypatch.setattr(_shard_files.torch, "load", tracked_load)
    with fuyou.init_empty():
        model = TinyGPT()
    fuyou.materialize(model, checkpoint=tmp_path / "hf")
    assert_models_close(model, ref, rtol=0, atol=0, what="HF checkpoint")
    index = json.loads((tmp_path / "hf" / "pytorch_model.bin.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert index["weight_map"]["blocks.0.proj.weight"] != index["weight_map"]["blocks.0.proj.bias"]
    assert loads == files + files  # the shape check's pass, then the load's
    assert not live


# --------------------------------------------------------------------- offload_params
def _offload(daemon, model_or_groups, job, **kw):
    kw.setdefault("chunk_bytes", CHUNK_BYTES)
    return fuyou.AdamW(model_or_groups, address=daemon.address, timeout=20.0, **HYPER,
                       offload_params=True, job=job, **kw)


def _shards(directory: Path, index_name: str) -> dict:
    """Every tensor of a sharded checkpoint's index, by key."""
    index = json.loads((directory / index_name).read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(directory / shard))
    assert set(out) == set(index["weight_map"])
    return out


def test_materialize_sends_each_module_to_the_daemon_and_frees_it(daemon, tmp_path):
    with fuyou.init_empty(job="mat-offload-a"):
        model = TinyGPT()
    opt = _offload(daemon, split_groups(model), job=None)  # the job init_empty recorded
    assert opt.job == "mat-offload-a"
    torch.manual_seed(5)
    fuyou.materialize(model, opt, init=_normal_init)
    assert opt.offload.registered
    for name, p in model.named_parameters():
        assert p.numel() == 0, f"{name} still holds its weights"  # a placeholder
    fuyou.export_checkpoint(opt, tmp_path / "ck", model=model, shard_bytes=16 << 10)
    weights = _shards(tmp_path / "ck", "model.safetensors.index.json")
    ref = _reference_init(make_model(seed=0), _normal_init, seed=5)
    for name, t in ref.state_dict().items():
        if name != "head.weight":  # tied: written once, as tok.weight
            assert torch.equal(weights[name], t), name
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_checkpoint_round_trips_into_an_offload_job(daemon, tmp_path, dtype):
    """A trained job's sharded export, materialized into a new offload_params job
    (weights through register_module, moments and step counts through the import),
    exports again bit-exact; the chunk layouts differ (module-aligned), the
    per-parameter states do not. In bf16 the fp32 masters survive too (the import
    writes them; the registered bf16 weights are their rounding)."""
    tag = str(dtype).split(".")[-1]
    model = make_model(dtype=dtype)
    opt = _adamw(daemon, split_groups(model), job=f"mat-round-a-{tag}")
    _train(model, opt, 0, 4)
    first = tmp_path / "first"
    fuyou.export_checkpoint(opt, first, model=model, shard_bytes=16 << 10)
    opt.close()

    with fuyou.init_empty():
        empty = TinyGPT().to(dtype)  # cast inside the block: free on meta
    opt2 = _offload(daemon, split_groups(empty, lr=9.0), job=f"mat-round-b-{tag}")
    fuyou.materialize(empty, opt2, checkpoint=first)
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-3)  # taken over
    second = tmp_path / "second"
    fuyou.export_checkpoint(opt2, second, model=empty, shard_bytes=16 << 10)
    for index_name in ("model.safetensors.index.json", "optimizer.safetensors.index.json"):
        a, b = _shards(first, index_name), _shards(second, index_name)
        assert set(a) == set(b), index_name
        for key in a:
            assert torch.equal(a[key], b[key]), f"{index_name}: {key}"
    meta_a = json.loads((first / "optimizer.safetensors.index.json").read_text())["metadata"]["fuyou"]
    meta_b = json.loads((second / "optimizer.safetensors.index.json").read_text())["metadata"]["fuyou"]
    assert meta_a["steps"] == meta_b["steps"] and set(meta_a["steps"].values()) == {4}
    assert meta_a["param_groups"] == meta_b["param_groups"]
    opt2.close()


def test_offload_materialize_refuses_a_mismatched_checkpoint_before_registering(daemon, tmp_path):
    model = make_model()
    opt = _adamw(daemon, split_groups(model), job="mat-bad-a")
    fuyou.export_checkpoint(opt, tmp_path / "ck", model=model, shard_bytes=16 << 10)
    opt.close()
    with fuyou.init_empty():
        wider = TinyGPT(d=48)
    opt2 = _offload(daemon, split_groups(wider), job="mat-bad-b")
    with pytest.raises(fuyou.InvalidArgument, match=r"'tok.weight' has shape \(64, 32\) there"):
        fuyou.materialize(wider, opt2, checkpoint=tmp_path / "ck")
    assert not any(b.registered for b in opt2.offload.blocks)
    opt2.close()


@pytest.mark.slow
def test_materialize_host_memory_is_bounded_by_a_module_not_the_model(tmp_path, monkeypatch):
    """32 Linear(1024, 1024) layers (128 MiB of fp32 weights; 384 MiB of optimizer
    states and 128 MiB of stored weights) into a fuyoud whose DRAM budget is 64 MiB.
    Each phase's rise of the client's peak RSS stays under a bound set from the
    largest module (4 MiB) and the shard size (8 MiB), below a third of the model:
    materialize with init: 6 modules; (one training step through
    stream_parameters, so that there are moments to export;) the sharded export:
    2 shards (weights and moments being filled) + 6 modules (a chunk's three states
    read, the parameter's three assembled) + a module of slack for the allocator;
    materialize from the checkpoint
    (weights, then the optimizer states): 2 shards + 6 modules."""
    from conftest import start_daemon
    monkeypatch.setenv("FUYOU_TEST_DAEMON_ARGS", "--dram-budget 64MiB")
    d = start_daemon(tmp_path)
    shard = 8 << 20
    try:
        env = dict(os.environ, PYTHONPATH=f"{REPO / 'python_client'}:{REPO / 'tests' / 'python'}")
        out = subprocess.run(
            [sys.executable, str(Path(__file__).parent / "materialize_worker.py"),
             "--address", d.address, "--job", "mat-rss", "--layers", "32", "--width", "1024",
             "--shard-bytes", str(shard), "--checkpoint", str(tmp_path / "ck")],
            env=env, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        figures = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        d.stop()
    print(figures)
    model, module = figures["model_bytes"], figures["largest_module_bytes"]
    assert model >= 128 << 20 and module < (5 << 20)
    assert 3 * model > 4 * figures["dram_budget_bytes"]  # the states exceed the budget
    bounds = {"materialize_init": 6 * module,
              "export_sharded": 2 * shard + 7 * module,
              "materialize_checkpoint": 2 * shard + 6 * module}
    for phase, bound in bounds.items():
        assert bound < model / 2.5
        assert figures[phase] < bound, (
            f"{phase} raised the peak RSS by {figures[phase] >> 20} MiB (bound {bound >> 20} MiB, "
            f"model {model >> 20} MiB)")


# --------------------------------------------------------------------- training
LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1
STREAM_RTOL, STREAM_ATOL = 1e-5, 1e-6  # fp32 tolerance against torch (test_stream_parameters)


def _stream_adamw(daemon, model, job, **kw):
    return fuyou.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                       address=daemon.address, timeout=20.0, chunk_bytes=8 << 10, num_slots=3,
                       offload_params=True, job=job, **kw)


def _train_streamed(model, opt, first, count):
    for step in range(first, first + count):
        model(*stream_batch(step)).backward()
        opt.step()
        opt.zero_grad()


def _daemon_weights(opt, ref) -> list:
    """The job's weights (export_checkpoint keyed by parameter index = the order
    of ref.parameters())."""
    weights = opt.export_checkpoint()["model"]
    return [weights[i] for i in range(len(list(ref.parameters())))]


def _assert_close_to(opt, ref, what):
    for (name, b), a in zip(ref.named_parameters(), _daemon_weights(opt, ref)):
        torch.testing.assert_close(a, b.detach(), rtol=STREAM_RTOL, atol=STREAM_ATOL,
                                   msg=lambda m: f"{what}: {name}: {m}")


def _never(module):
    raise AssertionError(f"init called for {type(module).__name__} on a resumed job")


def test_empty_model_materialized_streams_and_trains_like_the_normal_build(daemon, tmp_path):
    """A StreamGPT built in init_empty, materialized (init=) into an offload_params
    job and trained 4 steps through stream_parameters matches the same GPT built
    normally, initialised alike and trained with torch.optim.AdamW. Then: the job
    resumes in a new session without initialising anything (materialize takes the
    daemon's weights), and its sharded export, materialized into a new job, trains
    on bit-exact with it."""
    job = "mat-train-a"
    with fuyou.init_empty(job=job):
        model = StreamGPT(n_layer=4)
    opt = _stream_adamw(daemon, model, job=None)
    torch.manual_seed(5)
    fuyou.materialize(model, opt, init=_normal_init)
    handle = fuyou.stream_parameters(model, opt, device_budget="24KiB", prefetch=2)
    ref = _reference_init(StreamGPT(n_layer=4), _normal_init, seed=5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    assert sum(b.nbytes for b in opt.offload.blocks) >= 8 * (24 << 10)
    _assert_close_to(opt, ref, "as initialised")
    for step in range(4):
        _train_streamed(model, opt, step, 1)
        _train_streamed(ref, ref_opt, step, 1)
        _assert_close_to(opt, ref, f"step {step}")
    assert opt.committed_step == 4
    ckpt = tmp_path / "ckpt"
    fuyou.export_checkpoint(opt, ckpt, model=model, shard_bytes=24 << 10)
    handle.close()
    opt.close()

    # Resume: a new session on the job; nothing is initialised.
    with fuyou.init_empty():
        again = StreamGPT(n_layer=4)
    opt = _stream_adamw(daemon, again, job=job)
    fuyou.materialize(again, opt, init=_never)
    assert opt.offload.job_exists and opt.resumed
    handle = fuyou.stream_parameters(again, opt, device_budget="24KiB", prefetch=2)
    _assert_close_to(opt, ref, "resumed")

    # A new job from the sharded export trains on exactly like the original.
    with fuyou.init_empty():
        copy_model = StreamGPT(n_layer=4)
    copy_opt = _stream_adamw(daemon, copy_model, job="mat-train-b")
    fuyou.materialize(copy_model, copy_opt, checkpoint=ckpt)
    assert not copy_opt.resumed and copy_opt.committed_step == 0
    copy_handle = fuyou.stream_parameters(copy_model, copy_opt, device_budget="24KiB")
    for step in range(4, 7):
        _train_streamed(again, opt, step, 1)
        _train_streamed(copy_model, copy_opt, step, 1)
        _train_streamed(ref, ref_opt, step, 1)
        for a, b in zip(_daemon_weights(copy_opt, ref), _daemon_weights(opt, ref)):
            assert torch.equal(a, b), f"step {step}"
        _assert_close_to(opt, ref, f"step {step}")
    for h, o in ((handle, opt), (copy_handle, copy_opt)):
        h.close()
        o.close()
