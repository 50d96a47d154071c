"""Tests of the example models (the main job's transformers Llama of llama.py,
the GPT of gpt.py), the byte tokenizer and data pipeline, and tiny end-to-end
runs of python_client/examples/finetune_gpt.py (the main job's script)."""
import json
import pathlib
import sys

import pytest
import torch

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "python_client" / "examples"
sys.path.insert(0, str(EXAMPLES))

import finetune_gpt  # noqa: E402
import llama  # noqa: E402
from gpt import GPT, PRESETS, ByteTokenizer, GPTConfig  # noqa: E402


def test_byte_tokenizer_round_trips_ascii_and_utf8():
    tok = ByteTokenizer()
    for text in ["", "In the beginning", "naïve café — ünïcödé ✓\n\ttabs"]:
        ids = tok.encode(text)
        assert ids.dtype == torch.long
        assert ids.numel() == len(text.encode("utf-8"))
        if ids.numel():
            assert int(ids.min()) >= 0 and int(ids.max()) < tok.vocab_size
        assert tok.decode(ids) == text


def test_byte_tokenizer_decode_replaces_cut_multibyte_char():
    tok = ByteTokenizer()
    ids = tok.encode("é")[:1]
    assert tok.decode(ids) == "\ufffd"


def test_forward_shapes_and_loss():
    torch.manual_seed(0)
    cfg = PRESETS["nano"]
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (3, 17))
    logits, loss = model(x)
    assert logits.shape == (3, 17, cfg.vocab_size)
    assert loss is None
    _, loss = model(x, torch.randint(0, cfg.vocab_size, (3, 17)))
    assert loss.ndim == 0 and torch.isfinite(loss)
    # A fresh model predicts close to uniform on random targets: loss near ln(256).
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5


def test_attention_is_causal():
    torch.manual_seed(0)
    model = GPT(PRESETS["nano"]).eval()
    x = torch.randint(0, 256, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 256  # change only the future of position 7
    with torch.no_grad():
        a, _ = model(x)
        b, _ = model(y)
    assert torch.allclose(a[0, :8], b[0, :8], atol=1e-5)
    assert not torch.allclose(a[0, 8:], b[0, 8:])


def test_lm_head_is_tied_to_token_embedding():
    model = GPT(PRESETS["nano"])
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names
    assert not any("head" in n for n in names)
    cfg = PRESETS["nano"]
    expected = (cfg.vocab_size * cfg.n_embd + cfg.block_size * cfg.n_embd
                + cfg.n_layer * (12 * cfg.n_embd ** 2 + 13 * cfg.n_embd) + 2 * cfg.n_embd)
    assert model.num_parameters() == expected


def test_sequence_longer_than_block_is_refused():
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 5, dtype=torch.long))


def test_bfloat16_forward_gives_float32_loss():
    model = GPT(PRESETS["nano"]).to(torch.bfloat16)
    x = torch.randint(0, 256, (2, 8))
    logits, loss = model(x, x)
    assert logits.dtype == torch.bfloat16
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


def test_generate_appends_tokens():
    model = GPT(PRESETS["nano"])
    out = model.generate(torch.zeros(1, 3, dtype=torch.long), 5,
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 8)


def test_llama_presets_are_config_files_of_a_byte_vocabulary():
    assert {"nano", "medium", "main"} <= set(llama.PRESETS)
    for preset in llama.PRESETS:
        cfg = llama.load_config(llama.config_path(preset))
        assert cfg.model_type == "llama" and cfg.vocab_size == ByteTokenizer.vocab_size
        assert cfg.max_position_embeddings >= 64
    # The main job's: 25.6M parameters, fp32 states (12 bytes each) 4.5x and more
    # the embedded fuyoud's 64 MiB budget, so they stream from the SSD.
    import torch.nn as nn
    with torch.device("meta"):
        main = llama.LlamaLM(llama.load_config(llama.config_path("main")))
    assert 25e6 < main.num_parameters() < 26e6 and isinstance(main.hf, nn.Module)
    assert 12 * main.num_parameters() > 4.5 * (64 << 20)


def test_llama_forward_loss_and_generate():
    torch.manual_seed(0)
    model = llama.LlamaLM(llama.load_config(llama.config_path("nano")))
    assert type(model.hf).__name__ == "LlamaForCausalLM"
    x = torch.randint(0, 256, (3, 17))
    logits, loss = model(x)
    assert logits.shape == (3, 17, 256) and loss is None
    y = torch.randint(0, 256, (3, 17))
    _, loss = model(x, y)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
    assert torch.allclose(loss, expected)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, model.block_size + 1, dtype=torch.long))
    out = model.generate(torch.zeros(1, 3, dtype=torch.long), 5,
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 8)


def test_corpora_are_shipped_distinct_and_sized():
    base = finetune_gpt.BASE_CORPUS.read_text(encoding="utf-8")
    ft = finetune_gpt.FINETUNE_CORPUS.read_text(encoding="utf-8")
    assert 200_000 <= len(base.encode()) <= 2_000_000
    assert 100_000 <= len(ft.encode()) < len(base.encode())
    assert base.startswith("Genesis 1\n")
    assert "sqlite3_prepare" in ft
    assert (finetune_gpt.DATA_DIR / "README.md").exists()


def test_dataset_batches_are_shifted_windows():
    data = finetune_gpt.TextDataset(finetune_gpt.FINETUNE_CORPUS, ByteTokenizer())
    gen = torch.Generator().manual_seed(0)
    x, y = data.train_batch(4, 32, gen)
    assert x.shape == y.shape == (4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])
    val1 = [b[0] for b in data.val_batches(2, 4, 32)]
    val2 = [b[0] for b in data.val_batches(2, 4, 32)]
    assert all(torch.equal(a, b) for a, b in zip(val1, val2))  # eval is deterministic


def test_lr_schedule_warms_up_then_decays():
    lrs = [finetune_gpt.lr_at(i, 100, 1.0, 10) for i in range(100)]
    assert lrs[0] == pytest.approx(0.1)
    assert lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] >= 0.1


def test_args_defaults_and_validation(tmp_path):
    args = finetune_gpt.parse_args(["--job", "j1"])
    assert args.optimizer == "fuyou" and args.out_dir == pathlib.Path("runs/j1")
    assert args.arch == "llama" and args.model_config == llama.config_path("small")
    with pytest.raises(SystemExit):
        finetune_gpt.parse_args(["--seq-len", "4096"])
    with pytest.raises(SystemExit):
        finetune_gpt.parse_args(["--arch", "gpt", "--model-config", "x.json"])


def test_end_to_end_with_torch_optimizer(tmp_path, capsys):
    out = tmp_path / "run"
    rc = finetune_gpt.main(["--optimizer", "torch", "--model", "nano", "--steps", "3",
                            "--base-steps", "2", "--batch-size", "2", "--seq-len", "16",
                            "--eval-batches", "1", "--eval-every", "2", "--warmup", "1",
                            "--sample-bytes", "8", "--no-progress", "--out-dir", str(out)])
    assert rc == 0
    for name in ("base.pt", "finetuned.pt", "loss.png", "metrics.json", "hf/model.safetensors",
                 "hf/config.json"):
        assert (out / name).stat().st_size > 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["optimizer"] == "torch" and metrics["steps"] == 3
    # save_pretrained's directory: the script loaded it back and compared it
    assert metrics["hf_checkpoint"]["architecture"] == "LlamaForCausalLM"
    import transformers
    back = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    trained = torch.load(out / "finetuned.pt")["model"]
    for name, t in back.state_dict().items():
        assert torch.equal(t, trained["hf." + name]), name
    ckpt = torch.load(out / "finetuned.pt")
    assert set(ckpt) >= {"model", "optimizer"}
    # The base checkpoint loads back through --checkpoint.
    rc = finetune_gpt.main(["--optimizer", "torch", "--model", "nano", "--steps", "1",
                            "--checkpoint", str(out / "base.pt"), "--batch-size", "2",
                            "--seq-len", "16", "--eval-batches", "1", "--sample-bytes", "0",
                            "--no-progress", "--out-dir", str(tmp_path / "run2")])
    assert rc == 0
    assert "loaded" in capsys.readouterr().out


def test_end_to_end_with_the_example_gpt(tmp_path):
    out = tmp_path / "run"
    rc = finetune_gpt.main(["--arch", "gpt", "--optimizer", "torch", "--model", "nano",
                            "--steps", "2", "--base-steps", "1", "--batch-size", "2",
                            "--seq-len", "16", "--eval-batches", "1", "--warmup", "1",
                            "--sample-bytes", "0", "--no-progress", "--out-dir", str(out)])
    assert rc == 0 and not (out / "hf").exists()


def test_main_job_path_streams_states_from_ssd_and_prints_the_table(tmp_path, capsys, monkeypatch):
    """The main job's path (deploy/main-job.sh: --daemon embedded, states larger
    than the embedded fuyoud's DRAM budget) on small settings: a real fuyoud reads
    states from its storage, the side-by-side table is printed with those bytes,
    the loss and timeline PNGs are written, and the Llama is saved with
    save_pretrained. fuyoud's smallest budget is 64 MiB, so the model is
    'medium' (124 MiB of states) with 8-token batches."""
    from conftest import daemon_binary, require_daemon
    require_daemon()
    monkeypatch.setenv("FUYOU_DAEMON", daemon_binary())
    monkeypatch.setenv("FUYOU_DATA_DIR", str(tmp_path / "data"))
    out = tmp_path / "run"
    rc = finetune_gpt.main(["--daemon", "embedded", "--optimizer", "fuyou", "--model", "medium",
                            "--steps", "6", "--base-steps", "1", "--batch-size", "1",
                            "--seq-len", "8", "--eval-batches", "1", "--warmup", "1",
                            "--sample-bytes", "0", "--no-progress", "--chunk-bytes",
                            str(4 << 20), "--dram-budget", "64MiB", "--serial-steps", "2",
                            "--compare-steps", "2", "--device", "cpu", "--out-dir", str(out)])
    assert rc == 0
    for name in ("loss.png", "timeline.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "metrics.json").read_text())["summary"]
    assert summary["fuyou_state_bytes"] > summary["dram_budget_bytes"] == 64 << 20
    assert summary["ssd_bytes_read"] > 0 and summary["ssd_bytes_written"] > 0
    assert summary["cache_misses"] > 0
    assert summary["torch"]["ran"] and summary["torch"]["steps"] == 2
    assert summary["serial_steps"] == 2 and summary["overlap"] is not None
    printed = capsys.readouterr().out
    table = printed[printed.index("main job: fuyou.AdamW vs torch.optim.AdamW"):]
    read_gb = f"{summary['ssd_bytes_read'] / 1e9:.2f} GB"
    assert "SSD read / written" in table and read_gb in table and read_gb != "0.00 GB"
    for row in ("tokens/s, steady", "cache hit rate", "overlap (fb+opt)/step", "redo (loop_stats)"):
        assert row in table
    assert "AutoModelForCausalLM.from_pretrained loads it: LlamaForCausalLM" in printed
    # the torch comparison ran on a twin: fuyou's state_dict holds its moments
    states = torch.load(out / "finetuned.pt")["optimizer"]["state"]
    assert states and all(int(s["step"]) == 6 for s in states.values())
