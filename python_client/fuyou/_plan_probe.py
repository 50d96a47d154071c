"""The measurements of ``fuyou plan``: short probes of this machine.

  * ``disk_rate``: sequential O_DIRECT write (then fsync) and read of a scratch
    file in a storage path, ``threads`` requests of ``block`` bytes in flight
    (os.pwrite/os.preadv release the GIL), the file removed after. A filesystem
    that refuses O_DIRECT is probed buffered and said so (fuyoud opens it
    buffered too, with a warning, when allow_buffered is set).
  * ``kernel_rate``: the daemon's own AdamW update through a real fuyoud (the
    binary fuyou.AdamW would start) with the states in its DRAM tier:
    parameters updated a second of optimizer.step(), shared-memory copies and
    commit included (what a step pays beside the storage traffic).
  * ``matmul_rate``: the device's matmul FLOPS in the model's dtype.
  * ``gpu``: device memory and pinned host-device bandwidth (None without CUDA).
  * ``memory``: /proc/meminfo's MemTotal and MemAvailable.
  * ``daemon_settings``: the DRAM budget, storage paths and job quota from the
    same TOML file and defaults fuyoud reads.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ._sizes import parse_size

__all__ = ["disk_rate", "kernel_rate", "matmul_rate", "gpu", "memory", "daemon_settings",
           "free_for_jobs"]

_DEFAULT_CONFIG = "/etc/fuyou/fuyoud.toml"
_DEFAULT_BUDGET = 2 << 30  # fuyoud's built-in --dram-budget


def _open_direct(path: str, flags: int) -> Tuple[int, bool]:
    try:
        return os.open(path, flags | os.O_DIRECT, 0o600), True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return os.open(path, flags, 0o600), False


def disk_rate(directory: str, size: int = 512 << 20, block: int = 4 << 20,
              threads: int = 4) -> Dict[str, object]:
    """Write then read ``size`` bytes in ``directory``: {"read": B/s, "write": B/s,
    "direct": bool}. OSError (missing directory, no space) names the path."""
    size = max(block, size // block * block)
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(block))
    fd_path = tempfile.mktemp(prefix=".fuyou-plan-probe-", dir=directory)
    offsets = list(range(0, size, block))
    try:
        fd, direct = _open_direct(fd_path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            def write(off):
                if os.pwrite(fd, buf, off) != block:
                    raise OSError(errno.EIO, f"short write in {fd_path}")

            def read(off):
                rb = bufs[threading.get_ident() % len(bufs)]
                os.preadv(fd, [rb], off)

            bufs = [mmap.mmap(-1, block) for _ in range(threads)]
            with ThreadPoolExecutor(threads) as pool:
                t0 = time.perf_counter()
                list(pool.map(write, offsets))
                os.fsync(fd)
                write_s = time.perf_counter() - t0
                if not direct:  # a buffered read would measure the page cache
                    os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
                t0 = time.perf_counter()
                list(pool.map(read, offsets))
                read_s = time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        if os.path.exists(fd_path):
            os.unlink(fd_path)
    return {"read": size / read_s, "write": size / write_s, "direct": direct, "bytes": size}


def memory() -> Dict[str, int]:
    """{"total", "available"} in bytes from /proc/meminfo."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0]) * 1024
    return {"total": fields["MemTotal"], "available": fields.get("MemAvailable",
                                                                 fields["MemFree"])}


def _default_data_dir() -> str:
    if os.environ.get("FUYOU_DATA_DIR"):
        return os.environ["FUYOU_DATA_DIR"]
    if os.geteuid() == 0:
        return "/var/lib/fuyou"
    return str(Path.home() / ".local" / "share" / "fuyou")


def daemon_settings(config: Optional[str] = None, data_dirs: Optional[List[str]] = None,
                    dram_budget: Optional[str] = None) -> Dict[str, object]:
    """What fuyoud would run with: ``config`` (default /etc/fuyou/fuyoud.toml when
    it exists), then the flags given here, else fuyoud's built-in defaults.
    Returns {"config", "paths", "dram_budget", "job_quota"} (job_quota: a size,
    "auto" or "unlimited")."""
    table: dict = {}
    if config is None and os.path.exists(_DEFAULT_CONFIG):
        config = _DEFAULT_CONFIG
    if config:
        import tomllib
        with open(config, "rb") as f:
            table = tomllib.load(f)
    storage = table.get("storage", {})
    paths = list(data_dirs or storage.get("paths") or [_default_data_dir()])
    budget = dram_budget or table.get("memory", {}).get("dram_budget") or _DEFAULT_BUDGET
    return {"config": config, "paths": paths,
            "dram_budget": parse_size(budget, "dram_budget"),
            "job_quota": storage.get("job_quota", "auto")}


def free_for_jobs(path: str) -> Tuple[int, int]:
    """(bytes a job may fill on ``path``, the filesystem's size): the free space
    less fuyoud's reserved_free default (1% of the size, 64 MiB..4 GiB)."""
    st = os.statvfs(path)
    size = st.f_blocks * st.f_frsize
    reserved = min(4 << 30, max(64 << 20, size // 100))
    return max(0, st.f_bavail * st.f_frsize - reserved), size


def matmul_rate(device: str = "cpu", seconds: float = 1.0, dtype: str = "bf16") -> float:
    """FLOPS of square matmuls on ``device`` in ``dtype`` ("bf16", "fp16", "fp32"):
    the best of five bursts of ``seconds`` / 5, so that a burst slowed by other
    work on a shared machine does not stand for what the device can do."""
    import torch
    n = 1024 if device == "cpu" else 8192
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    torch.matmul(a, b)  # warm-up
    sync()
    best = 0.0
    for _ in range(5):
        reps = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds / 5:
            torch.matmul(a, b)
            reps += 1
            if device != "cpu" and reps % 10:
                continue
            sync()
        sync()
        best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - t0))
    return best


def gpu() -> Optional[Dict[str, float]]:
    """{"memory", "h2d", "d2h", "name"} of CUDA device 0, or None without CUDA."""
    import torch
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    host = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device="cuda")
    rates = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(8):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        rates[name] = 8 * host.numel() / (time.perf_counter() - t0)
    return {"memory": props.total_memory, "name": props.name, **rates}


def kernel_rate(binary: Optional[str] = None, params: int = 8 << 20, steps: int = 4,
                threads: int = 0) -> Dict[str, float]:
    """The daemon's AdamW update of ``params`` fp32 parameters held in its DRAM
    tier, as a job sees it (gradients in and weights out through shared memory,
    the kernel, the commit): {"params_per_s", "step_s"}, the median of ``steps``
    optimizer steps after the first (which registers the chunks), from a private
    fuyoud (``binary``, else the one fuyou.AdamW would start) with ``threads``
    workers (0: all cores) in a temporary directory."""
    import statistics
    import torch
    from .daemon import EmbeddedDaemon
    from .optimizer import AdamW
    with tempfile.TemporaryDirectory(prefix="fuyou-plan-") as tmp:
        daemon = EmbeddedDaemon(data_dir=os.path.join(tmp, "data"), binary=binary,
                                extra_args=["--dram-budget", f"{params * 16 * 2 >> 20}MiB",
                                            "--threads", str(threads), "--log-level", "warn"])
        try:
            p = torch.nn.Parameter(torch.zeros(params))
            opt = AdamW([p], lr=1e-3, job="plan-probe", address=daemon.address,
                        chunk_bytes=4 << 20, overlap=False, timeout=120)
            times = []
            try:
                for i in range(steps + 1):
                    p.grad = torch.full_like(p, 1e-3 * (i + 1))
                    t0 = time.perf_counter()
                    opt.step()
                    times.append(time.perf_counter() - t0)
            finally:
                opt.close()
        finally:
            daemon.stop()
    step_s = statistics.median(times[1:])
    return {"params_per_s": params / step_s, "step_s": step_s}
