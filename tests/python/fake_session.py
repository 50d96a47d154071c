"""An in-process fake of fuyou._fuyou.Session: same methods, torch.optim.AdamW's
arithmetic on fp32 masters, step commits and rollbacks, jobs kept across
sessions. Lets the optimizer's logic be tested without a daemon."""

from __future__ import annotations

import math
from collections import deque

import torch

from fuyou._errors import FailedPrecondition

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
        self.backup = {}
        self.log = []  # (kind, args) of every message, for assertions
        self.closed = False

    @property
    def committed_step(self):
        return self.job["committed"]

    def register_chunk(self, chunk_id, num_elements, param_dtype, grad_dtype, weights,
                       layout_fingerprint=0):
        mv = memoryview(weights).cast("B")
        dt = DTYPES[param_dtype]
        chunks = self.job["chunks"]
        if chunk_id in chunks:
            stored = chunks[chunk_id].get("fingerprint", 0)
            if stored not in (0, layout_fingerprint):  # as the daemon's CheckLayoutFingerprint
                raise FailedPrecondition(
                    f"chunk {chunk_id} was created for the parameter layout with fingerprint "
                    f"{stored:#018x}, but this model registers fingerprint {layout_fingerprint:#018x}")
            chunks[chunk_id]["fingerprint"] = layout_fingerprint or stored
        self.specs[chunk_id] = (num_elements, dt, DTYPES[grad_dtype])
        if chunk_id in chunks:
            master = chunks[chunk_id]["master"]
            torch.frombuffer(mv, dtype=dt, count=num_elements).copy_(master.to(dt))
            return True, chunks[chunk_id]["t"]
        w = torch.frombuffer(mv, dtype=dt, count=num_elements).float().clone()
        chunks[chunk_id] = {"master": w, "m": torch.zeros_like(w), "v": torch.zeros_like(w),
                            "t": 0, "fingerprint": layout_fingerprint}
        return False, 0

    def acquire_slot(self, timeout):
        if not self.free:
            raise FakeError("no free slot")
        return self.free.popleft()

    def release_slot(self, slot):
        assert slot not in self.free
        self.free.append(slot)

    def grad_region(self, slot):
        return memoryview(self.grad[slot])

    def param_region(self, slot):
        return memoryview(self.param[slot])

    def send_grad_ready(self, chunk_id, slot, step, lr, beta1, beta2, eps, weight_decay,
                        grad_scale=1.0):
        assert step == self.job["committed"] + 1, (step, self.job["committed"])
        self.log.append(("grad_ready", chunk_id, step, lr, weight_decay, grad_scale))
        n, pdt, gdt = self.specs[chunk_id]
        st = self.job["chunks"][chunk_id]
        if chunk_id not in self.backup:
            self.backup[chunk_id] = {k: (v.clone() if torch.is_tensor(v) else v)
                                     for k, v in st.items()}
        g = torch.frombuffer(self.grad[slot], dtype=gdt, count=n).float()
        if grad_scale not in (0.0, 1.0):
            g = g * torch.tensor(grad_scale, dtype=torch.float32)
        st["t"] += 1
        t = st["t"]
        p, m, v = st["master"], st["m"], st["v"]
        p.mul_(1 - lr * weight_decay)
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bc1 = 1 - beta1 ** t
        bc2 = 1 - beta2 ** t
        denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
        p.addcdiv_(m, denom, value=-lr / bc1)
        torch.frombuffer(self.param[slot], dtype=pdt, count=n).copy_(p.to(pdt))
        self.ready[chunk_id] = slot

    def wait_params(self, chunk_id, timeout):
        return self.ready.pop(chunk_id)

    def end_step(self, step):
        self.log.append(("end_step", step))
        self.job["committed"] = step
        n = len(self.backup)
        self.backup.clear()
        return step, n

    def abort_step(self, step):
        self.log.append(("abort_step", step))
        for cid, saved in self.backup.items():
            self.job["chunks"][cid] = saved
        self.backup.clear()

    def close(self):
        self.closed = True


def open_fake(job, num_slots, slot_bytes, client_info, address, rpc_timeout, connect_timeout):
    s = FakeSession(job, num_slots, slot_bytes)
    open_fake.last = s
    return s
