"""glibc's malloc set, once, to give the freed buffers of streamed weights back.

A streamed model on the CPU fetches every module's weights into a new buffer
and frees it once the weight cache evicts it. glibc raises its mmap threshold to
the size of each mmapped buffer freed (up to 32 MiB), after which module-sized
buffers come from its heap and, freed in between others, stay there: a client
streaming a 304M-parameter model grew by 1.1 GiB, still climbing each step. A
fixed threshold of 128 KiB (glibc's default start) keeps every such buffer
mmapped, and its memory goes back to the system when freed, so the client's
memory follows the streaming budget, not the model.

``fuyou.init_empty`` (whose modules build each parameter on the CPU and free
it), ``fuyou.AdamW(..., offload_params=True)`` unless every parameter is on a GPU
(before ``fuyou.materialize``, whose freed buffers would raise the threshold
too), and ``fuyou.stream_parameters`` when a streamed module's weights live on
the CPU call :func:`keep_large_buffers_mmapped`. It changes the whole process's
allocator (allocations of 128 KiB and more are mmapped from then on; torch's
CUDA memory is not malloc's and is not affected); ``FUYOU_MALLOC=glibc`` in the
environment leaves glibc's defaults (benchmarks/scale_bench.py's
``--malloc glibc`` shows the growth that way). Other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

__all__ = ["MALLOC_ENV", "MMAP_THRESHOLD", "keep_large_buffers_mmapped"]

MALLOC_ENV = "FUYOU_MALLOC"  # "glibc": leave glibc's dynamic threshold
MMAP_THRESHOLD = 128 << 10  # bytes
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
_log = logging.getLogger("fuyou")
_done = False


def keep_large_buffers_mmapped() -> bool:
    """Sets glibc's M_MMAP_THRESHOLD to MMAP_THRESHOLD, once per process.
    Returns True when it is set (now or before), False when not glibc, opted
    out through FUYOU_MALLOC=glibc, or mallopt refused."""
    global _done
    if _done:
        return True
    if os.environ.get(MALLOC_ENV, "").strip().lower() == "glibc":
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    except (OSError, AttributeError):
        ok = False
    if not ok:
        _log.warning("fuyou: mallopt(M_MMAP_THRESHOLD) failed; freed buffers of streamed "
                     "weights may stay in this process's heap")
        return False
    _done = True
    return True
