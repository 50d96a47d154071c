"""The SSD tier of activation offload (issue 23): saved activations written to
the daemon's storage tier through a session (SpillActivation /
RecallActivation / DropActivations in offload.proto) and read back for
backward.

:class:`SsdTier` owns one worker thread that does every transfer of the tier
in order (spills, recalls, drops), each a blocking call of the session
(clientlib, the GIL released): a spill is queued when its host copy exists
and runs while forward goes on; a recall is queued by the store's prefetch
(one layer ahead in backward, as the host tier) or on demand at unpack. As the
queue is FIFO, an activation's recall runs after its spill, and a drop after
every transfer queued before it. Keys are unique for the tier's life, so a
drop (queued when no spilled activation is alive any more) never meets a key
still wanted.

The daemon keeps the bytes in scratch files on its storage paths, checksummed,
never committed, charged to the user ([limits] max_activation_bytes_per_user),
and drops them all at the session's EndStep / AbortStep, at DropActivations
and when the session ends (a killed client leaves nothing).

The session: one of the tier's own, opened on a job of its own (2 slots) at
an address, or at a ``fuyou.AdamW``'s daemon, and closed (the job deleted) by
:meth:`SsdTier.close`; or a session given as it is. Why not the optimizer's
own session: its pipeline holds up to all of its slots during backward (a
chunk's slot until its weights are collected, freeing one only when it sends
the next chunk), so a recall that backward waits for could wait for a slot
that only more backward frees, until the RPC timeout. A session given as it
is must leave the tier a slot.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import itertools
import logging
import os
from typing import Optional

import torch

log = logging.getLogger("fuyou")

__all__ = ["SsdTier", "SpillStats", "OwnedJob", "open_ssd_tier"]

_tier_ids = itertools.count(1)


def _byte_view(t: torch.Tensor, nbytes: int):
    """A writable buffer over the first `nbytes` bytes of `t`'s memory (CPU)."""
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


class SpillStats:
    """What a tier moved: bytes spilled and recalled, drops queued, spills
    refused or failed and the last such error."""

    def __init__(self):
        self.bytes_spilled = self.bytes_recalled = 0
        self.drops = 0
        self.failed_spills = 0
        self.last_error: Optional[BaseException] = None

    def spill_failed(self, error: BaseException) -> None:
        """A spill was refused or failed (e.g. the user's limit): its activation
        keeps its host copy, beyond the host budget, which is logged once."""
        self.failed_spills += 1
        if self.last_error is None:
            log.warning("fuyou: an activation could not be spilled to the daemon (%s); it stays in "
                        "host memory, beyond host_budget", error)
        self.last_error = error


class OwnedJob:
    """The job a tier opened its own session on, at ``address``: deleted
    when the tier closes."""

    def __init__(self, job: str, address: Optional[str]):
        self.job, self.address = job, address

    def delete(self) -> None:
        try:
            from . import _native
            admin = _native.module().AdminClient.connect(address=self.address or "")
            admin.delete_job(self.job)
        except Exception:  # best effort: an empty job is harmless
            pass


class SsdTier:
    """Spills and recalls of saved activations through `session`.
    ``owned_job``: the tier opened the session (on that job) and closes it;
    None: the session was given. ``stats``: its :class:`SpillStats`."""

    def __init__(self, session, owned_job: Optional[OwnedJob] = None):
        self.session = session
        self.owned_job = owned_job
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fuyou-activation-ssd")
        self._keys = itertools.count(1)
        self.stats = SpillStats()
        self._closed = False

    def spill(self, host: torch.Tensor, nbytes: int, ready=None) -> tuple:
        """Queues the spill of `host`'s first `nbytes` bytes (kept alive by the
        task until written) after `ready` (a CUDA event: the copy into `host`)
        completes. Returns (key, future)."""
        key = next(self._keys)

        def run():
            if ready is not None:
                ready.synchronize()
            self.session.spill_activation(key, _byte_view(host, nbytes))
            self.stats.bytes_spilled += nbytes

        return key, self._pool.submit(run)

    def recall(self, key: int, shape, stride, dtype, nbytes: int, pin: bool):
        """Queues the recall of `key` into a new host tensor of that layout;
        the future's result is the tensor."""

        def run():
            out = torch.empty_strided(shape, stride, dtype=dtype, device="cpu", pin_memory=pin)
            self.session.recall_activation(key, _byte_view(out, nbytes))
            self.stats.bytes_recalled += nbytes
            return out

        return self._pool.submit(run)

    def spill_failed(self, error: BaseException) -> None:
        """A spill was refused or failed: see :meth:`SpillStats.spill_failed`."""
        self.stats.spill_failed(error)

    def drop(self) -> None:
        """Queues a DropActivations (after every transfer queued before it)."""
        if self._closed:
            return
        self.stats.drops += 1
        self._pool.submit(self.session.drop_activations)

    def flush(self) -> None:
        """Waits for every transfer queued so far."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        """Waits for the queued transfers; closes an own session (and deletes its job)."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        if self.owned_job is not None:
            try:
                self.session.close()
            finally:
                self.owned_job.delete()


def open_ssd_tier(target, slot_bytes: int = 4 << 20) -> SsdTier:
    """The tier for `target`: a session (used, not owned), a daemon address
    or a fuyou.AdamW (a session of its own at that daemon, 2 slots of
    `slot_bytes`)."""
    if hasattr(target, "spill_activation"):
        return SsdTier(target)
    if not isinstance(target, str):
        address = getattr(target, "_address", None)
        if not isinstance(address, str):
            raise TypeError(f"ssd= takes a fuyou.AdamW, a session or a daemon address; got {target!r}")
        target = address
    if isinstance(target, str):
        from . import _native
        job = f"activations-{os.getpid()}-{next(_tier_ids)}"
        session = _native.module().Session.open(job=job, num_slots=2, slot_bytes=slot_bytes,
                                                client_info="fuyou activation offload (ssd tier)",
                                                address=target)
        return SsdTier(session, OwnedJob(job, target))
