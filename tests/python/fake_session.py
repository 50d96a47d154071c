"""An in-process fake of fuyou._fuyou.Session: same methods, torch.optim.AdamW's
arithmetic on fp32 masters, step commits and rollbacks, jobs kept across
sessions. Lets the optimizer's logic be tested without a daemon.

Chunks registered with store_weights keep their working weights (param dtype)
as the daemon does: a new chunk's are the weights it was registered with, each
commit stores master.to(param dtype) of the chunks the step updated, and
send_fetch_weights/wait_weights give the committed ones (also during a step,
whatever the chunk's own update). Refused like the daemon and clientlib: a
chunk not registered in the session (InvalidArgument), one without
store_weights, a resume with the other store_weights, a slot not acquired or in
flight (FailedPrecondition), a slot that does not exist (InvalidArgument)."""

from __future__ import annotations

import math
from collections import deque

import torch

from fuyou._errors import FailedPrecondition, InvalidArgument

DTYPES = {1: torch.float32, 2: torch.bfloat16, 3: torch.float16}
JOBS: dict = {}


class FakeError(Exception):
    pass


class FakeSession:
    def __init__(self, job, num_slots, slot_bytes, **_):
        self.job = JOBS.setdefault(job, {"chunks": {}, "committed": 0})
        self.num_slots = num_slots
        self.slot_bytes = (slot_bytes + 4095) // 4096 * 4096
        self.grad = [bytearray(self.slot_bytes) for _ in range(num_slots)]
        self.param = [bytearray(self.slot_bytes) for _ in range(num_slots)]
        self.free = deque(range(num_slots))
        self.specs = {}
        self.ready = {}
        self.fetched = {}  # chunk_id -> deque of slots whose fetch was answered, oldest first
        self.in_flight = set()  # slots of fetches not yet taken by wait_weights
        self.backup = {}
        self.journal = {}  # chunk -> its journaled gradients of the step (grad dtype)
        self.journal_stats_by_chunk = {}
        self.log = []  # (kind, args) of every message, for assertions
        self.redone = []  # (chunk_id, RedoReason) of every redo
        self.aborts = []  # (step, AbortReason) of every AbortStep
        self.closed = False

    @property
    def committed_step(self):
        return self.job["committed"]

    def register_chunk(self, chunk_id, num_elements, param_dtype, grad_dtype, weights,
                       layout_fingerprint=0, segment_elements=(), store_weights=False,
                       moments_dtype=1):
        mv = memoryview(weights).cast("B")
        dt = DTYPES[param_dtype]
        chunks = self.job["chunks"]
        segments = list(segment_elements) or [num_elements]
        assert sum(segments) == num_elements, (segments, num_elements)
        if chunk_id in chunks:
            stored = chunks[chunk_id].get("fingerprint", 0)
            if stored not in (0, layout_fingerprint):  # as the daemon's CheckLayoutFingerprint
                raise FailedPrecondition(
                    f"chunk {chunk_id} was created for the parameter layout with fingerprint "
                    f"{stored:#018x}, but this model registers fingerprint {layout_fingerprint:#018x}")
            if chunks[chunk_id].get("store_weights", False) != bool(store_weights):  # as the daemon
                have = "with" if chunks[chunk_id].get("store_weights", False) else "without"
                raise FailedPrecondition(
                    f"chunk {chunk_id} was created {have} store_weights; it cannot be resumed "
                    f"with store_weights={bool(store_weights)}")
            if chunks[chunk_id].get("moments_dtype", 1) != moments_dtype:  # as the daemon's CheckResumable
                have = {1: "float32", 2: "bfloat16", 4: "8-bit blocks"}[chunks[chunk_id].get("moments_dtype", 1)]
                raise FailedPrecondition(
                    f"job chunk {chunk_id} keeps its Adam moments (m, v) as {have}, but this "
                    f"registration asks for {({1: 'float32', 2: 'bfloat16', 4: '8-bit blocks'})[moments_dtype]}")
            chunks[chunk_id]["fingerprint"] = layout_fingerprint or stored
        self.specs[chunk_id] = (num_elements, dt, DTYPES[grad_dtype])
        if chunk_id in chunks:
            st = chunks[chunk_id]
            committed = st["weights"] if st.get("store_weights") else st["master"]
            torch.frombuffer(mv, dtype=dt, count=num_elements).copy_(committed.to(dt))
            counts = st["segment_t"]
            same = all(t == counts[0] for t in counts)
            return True, max(counts), ([] if same else list(counts))
        w = torch.frombuffer(mv, dtype=dt, count=num_elements).float().clone()
        chunks[chunk_id] = {"master": w, "m": torch.zeros_like(w), "v": torch.zeros_like(w),
                            "segments": segments, "segment_t": [0] * len(segments),
                            "fingerprint": layout_fingerprint,
                            "store_weights": bool(store_weights),
                            "moments_dtype": moments_dtype}  # kept, not rounded: the fake keeps fp32
        if store_weights:  # the weights as given, in their own dtype
            chunks[chunk_id]["weights"] = torch.frombuffer(mv, dtype=dt, count=num_elements).clone()
        return False, 0, []

    def acquire_slot(self, timeout):
        if not self.free:
            raise FakeError("no free slot")
        return self.free.popleft()

    def release_slot(self, slot):
        assert slot not in self.free
        assert slot not in self.in_flight, f"slot {slot} is in flight (take it with wait_weights)"
        self.free.append(slot)

    def grad_region(self, slot):
        return memoryview(self.grad[slot])

    def param_region(self, slot):
        return memoryview(self.param[slot])

    def send_grad_ready(self, chunk_id, slot, step, hyper, grad_scale=1.0, *,
                        segments_without_grad=(), speculative=False, redo=0, journal=0,
                        grad_ops=()):
        # As the binding: the five attributes of fuyou._protocol.Hyper, read once.
        lr, beta1, beta2, eps, weight_decay = (hyper.lr, hyper.beta1, hyper.beta2, hyper.eps,
                                               hyper.weight_decay)
        assert step == self.job["committed"] + 1, (step, self.job["committed"])
        self.log.append(("grad_ready", chunk_id, step, lr, weight_decay, grad_scale))
        self.log.append(("grad_ready_flags", chunk_id, tuple(segments_without_grad),
                         bool(speculative), int(redo)))
        n, pdt, gdt = self.specs[chunk_id]
        st = self.job["chunks"][chunk_id]
        if chunk_id in self.backup:
            if not redo:  # as the daemon: a second update of a chunk in a step is refused
                raise FailedPrecondition(f"chunk {chunk_id} was already updated in step {step}")
            self.redone.append((chunk_id, int(redo)))
            saved = self.backup[chunk_id]
            for k, v in saved.items():
                st[k] = v.clone() if torch.is_tensor(v) else (list(v) if isinstance(v, list) else v)
        else:
            self.backup[chunk_id] = {k: (v.clone() if torch.is_tensor(v) else
                                         (list(v) if isinstance(v, list) else v))
                                     for k, v in st.items()}
        if grad_ops and journal not in (2, 3):
            raise InvalidArgument(f"chunk {chunk_id}: grad_ops only with JOURNAL_ADD or JOURNAL_REPLAY")
        if journal in (2, 3) and (not redo or chunk_id not in self.journal):
            raise FailedPrecondition(f"chunk {chunk_id} has no gradient journal in step {step}")
        if journal == 0:
            g = torch.frombuffer(self.grad[slot], dtype=gdt, count=n).float()
        else:  # as the daemon: every op in the grad dtype, rounded after each
            if journal == 1:
                kept = torch.frombuffer(self.grad[slot], dtype=gdt, count=n).clone()
                offset = 0
                for i, size in enumerate(st["segments"]):
                    if i in set(segments_without_grad):
                        kept[offset:offset + size] = 0
                    offset += size
            else:
                kept = self.journal[chunk_id]
                for kind, operand in grad_ops:
                    kept = kept.mul(operand) if kind == 1 else kept.div(operand)
                if journal == 2:
                    kept = kept + torch.frombuffer(self.grad[slot], dtype=gdt, count=n)
            self.journal[chunk_id] = kept
            sums, maxes, offset = [], [], 0
            for size in st["segments"]:
                piece = kept[offset:offset + size].double()
                offset += size
                sums.append(float((piece * piece).sum()))
                maxes.append(float("nan") if bool(piece.isnan().any()) else float(piece.abs().max()))
            self.journal_stats_by_chunk[chunk_id] = (sums, maxes)
            g = kept.float()
        if journal == 0:
            self.journal_stats_by_chunk.pop(chunk_id, None)
        if grad_scale not in (0.0, 1.0):
            g = g * torch.tensor(grad_scale, dtype=torch.float32)
        skip = set(segments_without_grad)
        offset = 0
        # torch.optim.AdamW's arithmetic, per segment (each has its own Adam t).
        for i, size in enumerate(st["segments"]):
            sl = slice(offset, offset + size)
            offset += size
            if i in skip:
                continue
            st["segment_t"][i] += 1
            t = st["segment_t"][i]
            p, m, v, gs = st["master"][sl], st["m"][sl], st["v"][sl], g[sl]
            p.mul_(1 - lr * weight_decay)
            m.mul_(beta1).add_(gs, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(gs, gs, value=1 - beta2)
            bc1 = 1 - beta1 ** t
            bc2 = 1 - beta2 ** t
            denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
            p.addcdiv_(m, denom, value=-lr / bc1)
        torch.frombuffer(self.param[slot], dtype=pdt, count=n).copy_(st["master"].to(pdt))
        self.ready[chunk_id] = slot

    def journal_stats(self, chunk_id):
        return self.journal_stats_by_chunk.get(chunk_id)

    def wait_params(self, chunk_id, timeout):
        return self.ready.pop(chunk_id)

    def send_fetch_weights(self, chunk_id, slot):
        self.log.append(("fetch_weights", chunk_id, slot))
        if chunk_id not in self.specs:
            raise InvalidArgument(f"FetchWeights: chunk {chunk_id} is not registered in this session")
        st = self.job["chunks"][chunk_id]
        if not st.get("store_weights"):
            raise FailedPrecondition(f"FetchWeights: chunk {chunk_id} was registered without store_weights")
        if not 0 <= slot < self.num_slots:
            raise InvalidArgument(f"FetchWeights of chunk {chunk_id}: slot {slot} does not exist")
        if slot in self.free or slot in self.in_flight:
            raise FailedPrecondition(f"FetchWeights of chunk {chunk_id}: slot {slot} is "
                                     f"{'free' if slot in self.free else 'already in flight'}")
        n, pdt, _ = self.specs[chunk_id]
        # The committed weights: a step's updates reach them only at end_step.
        torch.frombuffer(self.param[slot], dtype=pdt, count=n).copy_(st["weights"])
        self.in_flight.add(slot)
        self.fetched.setdefault(chunk_id, deque()).append(slot)

    def wait_weights(self, chunk_id, timeout):
        slots = self.fetched.get(chunk_id)
        if not slots:
            raise FailedPrecondition(f"chunk {chunk_id} has no weights fetch in flight")
        slot = slots.popleft()
        self.in_flight.discard(slot)
        return slot

    def end_step(self, step):
        self.log.append(("end_step", step))
        self.job["committed"] = step
        for cid in self.backup:  # the daemon stores the new working weights at the commit
            st = self.job["chunks"][cid]
            if st.get("store_weights"):
                st["weights"] = st["master"].to(self.specs[cid][1])
        n = len(self.backup)
        self.backup.clear()
        self.journal.clear()
        return step, n, step  # commits at once: the step is durable when answered

    def wait_durable(self, step):
        self.log.append(("wait_durable", step))
        if step > self.job["committed"]:
            raise FailedPrecondition(f"WaitDurable for step {step}: not committed")
        return self.job["committed"]  # every step is durable when answered

    def abort_step(self, step, reason=0):
        self.log.append(("abort_step", step))
        self.aborts.append((step, int(reason)))
        for cid, saved in self.backup.items():
            self.job["chunks"][cid] = saved
        self.backup.clear()
        self.journal.clear()

    def read_state(self, chunk_id, which, first, out):
        st = self.job["chunks"][chunk_id]
        src = {1: st["master"], 2: st["m"], 3: st["v"]}[which]
        dst = torch.from_numpy(out)
        dst.copy_(src[first:first + dst.numel()])
        return max(st["segment_t"])

    def close(self):
        self.closed = True


def open_fake(job, num_slots, slot_bytes, client_info, address, rpc_timeout, connect_timeout):
    s = FakeSession(job, num_slots, slot_bytes)
    open_fake.last = s
    return s
