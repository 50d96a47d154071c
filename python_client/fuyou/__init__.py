"""fuyou: AdamW for PyTorch with optimizer states on NVMe SSDs, run by fuyoud.

    import fuyou
    opt = fuyou.AdamW(model.parameters(), lr=1e-4, job="my-run")
    ...
    loss.backward(); opt.step(); opt.zero_grad()

See fuyou.AdamW for mixed precision, clipping, accumulation and resuming, and
fuyou.EmbeddedDaemon for the private daemon started when none is running.
"""

from __future__ import annotations

from typing import Optional

from ._errors import (DaemonUnavailable, DeadlineExceeded, FailedPrecondition, FuyouError,
                      InvalidArgument)
from .daemon import EmbeddedDaemon, UntrustedDaemon, default_socket_path, find_daemon_binary
from ._admin import admin_client, admin_stats
from ._loop_stats import LoopStats
from ._materialize import init_empty, materialize
from .optimizer import AdamW
from ._stream import ParameterStream, stream_parameters
from ._activations import ActivationOffload, offload_activations
from ._sizes import parse_size
from . import _dp_export, _sharded
from ._ddp_skip import skip_ddp_allreduce

__all__ = [
    "AdamW",
    "LoopStats",
    "stream_parameters",
    "ParameterStream",
    "offload_activations",
    "ActivationOffload",
    "parse_size",
    "EmbeddedDaemon",
    "FuyouError",
    "DaemonUnavailable",
    "UntrustedDaemon",
    "InvalidArgument",
    "FailedPrecondition",
    "DeadlineExceeded",
    "admin_stats",
    "export_checkpoint",
    "init_empty",
    "materialize",
    "admin_client",
    "default_socket_path",
    "find_daemon_binary",
    "skip_ddp_allreduce",
]

__version__ = "0.1.0"


def export_checkpoint(optimizer: AdamW, path=None, model=None, *,
                      shard_bytes: Optional[int] = None) -> dict:
    """``optimizer.export_checkpoint(path, model)``: the job's weights and a
    torch.optim.AdamW-compatible optimizer state as a PyTorch checkpoint.

    ``shard_bytes`` given: a *sharded* checkpoint in the directory ``path``
    instead, in the Hugging Face layout: ``model.safetensors.index.json`` and
    ``model-0000i-of-0000n.safetensors`` shards of fp32 weights by ``model``'s
    state_dict names (and ``config.json`` for a ``transformers`` model, so that
    ``AutoModelForCausalLM.from_pretrained(path)`` loads it), plus
    ``optimizer.safetensors.index.json`` and shards of the moments (see
    fuyou/_sharded.py). It is read from the daemon one chunk at a time and
    written shard by shard, so the model is never whole in memory. It works for
    an ``offload_params`` optimizer too, and in a data-parallel group: there it
    is a collective, call it on every rank; rank 0 writes the whole job's
    checkpoint, each chunk read by its owner (fuyou/_dp_export.py). Load it back
    with ``fuyou.materialize(model, opt, checkpoint=path)`` (weights, and the
    optimizer states into a new job) or ``fuyou.AdamW(..., init_from=path)``;
    ``materialize`` also loads a checkpoint that ``save_pretrained`` wrote.
    Returns a summary (files, peak bytes held)."""
    if shard_bytes is None:
        return optimizer.export_checkpoint(path, model)
    if path is None:
        raise InvalidArgument("export_checkpoint(shard_bytes=...) needs the directory path")
    with optimizer._lock:
        optimizer._check_usable()
        if optimizer.pipeline.step.in_step:
            raise FailedPrecondition(f"export_checkpoint of job {optimizer.job!r} during a step: "
                                     "call it after step()")
        optimizer._mode.quiesce()  # states are read only with no fetch in flight
        if optimizer._data_parallel is not None:  # every rank's chunks, written by rank 0
            return _dp_export.export_sharded_together(optimizer, path, model, int(shard_bytes))
        return _sharded.export_sharded(optimizer, optimizer.pipeline, path, model,
                                       int(shard_bytes))
