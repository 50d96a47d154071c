"""fuyou plan (issue 35 item 3): the arithmetic of fuyou/_plan_model.py against
hand-computed cases and transformers' own parameter counts, and one real short
run of ``python -m fuyou.plan`` (disk probe, kernel probe through a real fuyoud)."""

import json
import os

import pytest
import torch

from fuyou import _plan_model as pm
from fuyou import _plan_probe as probe
from fuyou import plan as plan_cli

GB = 1e9
MiB = 1 << 20


def machine(**kw):
    base = dict(disk_read=[2 * GB], disk_write=[1 * GB], disk_free=[3000 * GB],
                kernel_params_per_s=1 * GB, host_total=768 << 30, host_available=700 << 30,
                dram_budget=64 * MiB, compute_flops=100e12, gpu_memory=24 << 30,
                h2d=25 * GB, d2h=25 * GB)
    base.update(kw)
    return pm.Machine(**base)


def test_hf_config_counts_as_transformers_builds_it():
    transformers = pytest.importorskip("transformers")
    llama = dict(hidden_size=256, num_hidden_layers=3, intermediate_size=688,
                 num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                 tie_word_embeddings=False)
    gpt2 = dict(n_embd=128, n_layer=2, n_head=4, vocab_size=500, n_positions=64)
    with torch.device("meta"):
        built = {
            "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama)),
            "gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(**gpt2)),
        }
    for name, cfg in (("llama", llama), ("gpt2", gpt2)):
        real = sum(p.numel() for p in built[name].parameters())  # ties counted once
        assert pm.shape_from_hf_config(cfg).params == real, name


def test_size_alone_gives_llama_proportions():
    for n in (7e9, 70e9, 175e9):
        s = pm.shape_from_params(n)
        llama = s.layers * 12 * s.hidden ** 2 + 2 * s.vocab * s.hidden
        assert abs(llama - n) / n < 0.03
        assert s.hidden % 128 == 0
    s7 = pm.shape_from_params(6.74e9)
    assert (s7.hidden, s7.layers) == (4096, 32)  # Llama 2 7B's shape
    with pytest.raises(ValueError, match="--params"):
        pm.shape_from_params(0)


def test_streamed_step_bytes_and_bounds_by_hand():
    n = 10 ** 9
    shape = pm.ModelShape(params=n, layers=24, hidden=2048, vocab=32000,
                          largest_module_params=32000 * 2048)
    work = pm.Workload(tokens=4096)
    m = machine()
    p = pm.make_plan(shape, work, m, stream_weights=True)
    # a 64 MiB budget keeps nothing beyond its window: every state and weight moves
    assert p.read_bytes == 12 * n + 2 * 2 * n
    journal = 2 * n - 32 * MiB
    assert p.write_bytes == 12 * n + 2 * n + journal
    assert p.bounds["storage"] == pytest.approx(16 * n / (2 * GB) + (14 * n + journal) / GB)
    assert p.bounds["kernel"] == pytest.approx(1.0)
    assert p.bounds["compute"] == pytest.approx(8 * n * 4096 / 100e12)
    assert p.bounds["pcie"] == pytest.approx(4 * n / (25 * GB))
    assert p.binding == "storage" and p.step_s == p.bounds["storage"]
    assert p.tb_written_per_day == pytest.approx(p.write_bytes / p.step_s * 86400 / 1e12)
    assert p.storage_bytes == 2 * (12 + 2) * n + journal
    # a budget that holds the whole model: nothing read, every chunk still made durable
    big = pm.make_plan(shape, work, machine(dram_budget=64 << 30), stream_weights=True)
    assert big.read_bytes == 0 and big.write_bytes == 14 * n
    # two paths striped: twice the rate, half the storage time
    two = pm.make_plan(shape, work, machine(disk_read=[2 * GB] * 2, disk_write=[GB] * 2),
                       stream_weights=True)
    assert two.bounds["storage"] == pytest.approx(p.bounds["storage"] / 2)


def test_what_binds_and_what_must_stream():
    work = pm.Workload(tokens=8 * 2048)
    small = pm.shape_from_params(1e9)
    huge = pm.shape_from_params(175e9)
    fits = pm.make_plan(small, work, machine(dram_budget=32 << 30, disk_write=[50 * GB]))
    assert not fits.stream_weights  # 4 GB of weights and gradients in a 24 GiB GPU
    assert fits.read_bytes == 0  # the states all in DRAM, written back at 50 GB/s
    assert fits.binding == "compute"  # 8 x 1e9 x 16384 FLOPs at 100 TFLOPS > the rest
    big = pm.make_plan(huge, work, machine())
    assert big.stream_weights and big.binding == "storage"
    slow_link = pm.make_plan(small, pm.Workload(tokens=16), machine(h2d=1e8, d2h=1e8,
                                                                    dram_budget=16 << 30))
    assert slow_link.binding == "pcie"
    cpu = pm.make_plan(small, pm.Workload(tokens=64, weight_bytes=4, grad_bytes=4),
                       machine(gpu_memory=None, h2d=None, d2h=None, compute_flops=30e9,
                               kernel_params_per_s=2e8, host_available=20 << 30))
    assert "pcie" not in cpu.bounds
    assert cpu.step_s == pytest.approx(max(cpu.bounds["storage"],
                                           cpu.bounds["compute"] + cpu.bounds["kernel"]))


def test_largest_model_and_chunk_size():
    work = pm.Workload(tokens=1)
    m = machine(disk_free=[54 * GB], job_quota=None)
    assert pm.largest_params(work, m) == int(54 * GB // 30)  # 2 x (12 + 2) + 2 bytes
    assert pm.largest_params(work, machine(disk_free=[54 * GB], job_quota=30 * GB)) == \
        int(30 * GB // 30)
    shape = pm.shape_from_params(70e9)
    for budget in (64 * MiB, 2 << 30, 64 << 30):
        c = pm.pick_chunk_bytes(shape, work, machine(dram_budget=budget))
        assert c & (c - 1) == 0
        states = c // work.weight_bytes * work.state_bytes
        assert 8 * MiB <= states <= 256 * MiB
    tiny = pm.shape_from_params(1e6)
    assert pm.pick_chunk_bytes(tiny, work, machine()) >= MiB


def test_disk_probe_is_real_and_cleans_up(tmp_path):
    r = probe.disk_rate(str(tmp_path), size=8 * MiB, block=MiB, threads=2)
    assert r["read"] > 0 and r["write"] > 0 and r["bytes"] == 8 * MiB
    assert os.listdir(tmp_path) == []
    with pytest.raises(OSError):
        probe.disk_rate(str(tmp_path / "missing"), size=MiB, block=MiB)


def test_settings_read_as_fuyoud_reads_them(tmp_path):
    cfg = tmp_path / "fuyoud.toml"
    cfg.write_text('[storage]\npaths = ["/a", "/b"]\njob_quota = "100GiB"\n'
                   '[memory]\ndram_budget = "8GiB"\n')
    s = probe.daemon_settings(str(cfg))
    assert s["paths"] == ["/a", "/b"] and s["dram_budget"] == 8 << 30
    assert s["job_quota"] == "100GiB"
    assert probe.daemon_settings(str(cfg), ["/c"], "1GiB")["paths"] == ["/c"]
    assert probe.daemon_settings(str(cfg), None, "1GiB")["dram_budget"] == 1 << 30


def test_plan_runs_on_this_machine(tmp_path, capsys):
    out = tmp_path / "plan.json"
    binary = os.environ.get("FUYOU_DAEMON")
    args = ["--params", "7e9", "--data-dir", str(tmp_path), "--probe-bytes", "16MiB",
            "--dram-budget", "1GiB", "--tokens", "512", "--endurance-tbw", "600",
            "--json", str(out)] + (["--fuyoud", binary] if binary else [])
    assert plan_cli.main(args) == 0
    text = capsys.readouterr().out
    for what in ("measured " + str(tmp_path), "AdamW update", "bytes per tier",
                 "<- binds", "TB a day", "TBW last", "largest model"):
        assert what in text
    got = json.loads(out.read_text())
    assert got["plan"]["step_s"] == max(got["plan"]["bounds"]["storage"],
                                        got["plan"]["bounds"]["compute"]
                                        + got["plan"]["bounds"]["kernel"]) or \
        "pcie" in got["plan"]["bounds"]
    assert got["machine"]["kernel_params_per_s"] > 0
    assert [f for f in os.listdir(tmp_path) if f != "plan.json"] == []


def test_plan_names_what_it_cannot_measure(tmp_path):
    with pytest.raises(SystemExit, match="storage path .*missing does not exist.*--data-dir"):
        plan_cli.main(["--params", "1e9", "--data-dir", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="--fuyoud, or give the rate with --kernel-gparams"):
        plan_cli.main(["--params", "1e9", "--data-dir", str(tmp_path), "--probe-bytes", "4MiB",
                       "--fuyoud", str(tmp_path / "no-fuyoud")])
