"""benchmarks/deepspeed_side_by_side.py's argument handling, without deepspeed
(the benchmark itself runs in its own venv through deepspeed_side_by_side.sh;
CI installs no deepspeed)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "deepspeed_side_by_side.py"


def load():
    spec = importlib.util.spec_from_file_location("deepspeed_side_by_side", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_defaults_and_sizes():
    bench = load()
    args = bench.parse_args([])
    assert args.parts == ["kernel", "io", "zero3"]
    assert args.thread_counts == [1, 2] and args.variants == ["infinity"]
    assert (args.io_bytes, args.bs_bytes) == (1 << 30, 1 << 20)
    args = bench.parse_args(["--parts", "io", "--io-size", "64MiB", "--bs", "4096",
                             "--zero3-variants", "infinity,opt-nvme"])
    assert args.parts == ["io"] and args.io_bytes == 64 << 20 and args.bs_bytes == 4096
    assert args.variants == ["infinity", "opt-nvme"]


@pytest.mark.parametrize("argv", [
    ["--parts", "kernel,gpu"],
    ["--bs", "1000"],
    ["--io-size", "3M", "--bs", "2M"],
    ["--io-size", "lots"],
    ["--threads", "0"],
    ["--zero3-variants", "zero2"],
    ["--steps", "5", "--skip-steps", "5"],
])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as e:
        load().parse_args(argv)
    assert e.value.code == 2


def test_without_deepspeed_it_says_how_to_run_it():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--parts", "io"],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode == 0:
        pytest.skip("this interpreter has deepspeed")
    assert "deepspeed_side_by_side.sh" in proc.stderr
