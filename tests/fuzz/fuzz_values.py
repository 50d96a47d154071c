"""Hypothesis strategies for the RPC fuzzer: field values and whole messages.

Every strategy mixes three kinds of values: sane ones (so that sequences reach
deep code: a registered chunk, a step, an import), the edges where arithmetic
breaks (0, 1, 2^31, 2^32-1, 2^62+1, 2^63, 2^64-1, negative int64, NaN, inf), and
anything at all of the field's type. `mutated()` turns a valid serialized
message into hostile bytes (bit flips, cut, spliced, lengths that lie).
"""

import math
import random

from hypothesis import strategies as st

import admin_pb2  # noqa: F401  (generated at build time from proto/)
import offload_pb2 as pb

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
I64_MIN = -(2**63)
I64_MAX = 2**63 - 1

U32_EDGES = [0, 1, 2, 3, 7, 63, 64, 65, 255, 4096, 2**31 - 1, 2**31, 2**32 - 2, U32_MAX]
U64_EDGES = [0, 1, 2, 3, 4095, 4096, 4097, 2**20, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1,
             2**57, 2**61, 2**62, 2**62 + 1, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 4096, 2**64 - 4095,
             2**64 - 2, U64_MAX]
I64_EDGES = [0, 1, 2, -1, -2, 2**31, 2**32 - 1, 2**62 + 1, I64_MAX - 1, I64_MAX, I64_MIN, I64_MIN + 1, -(2**31)]
F32_EDGES = [0.0, -0.0, 1.0, -1.0, 0.5, 0.9, 0.999, 1e-3, 1e-8, 1e-45, 3.4028234663852886e38,
             -3.4028234663852886e38, math.inf, -math.inf, math.nan]

# Job names the fuzzer uses most: few, so sessions collide on them (resume, a job
# already open, delete while open). Odd names probe the name check.
JOB_NAMES = ["fz-a", "fz-b", "fz-c", "fz-d", "fz-e", "fz-f"]
# The jobs each example starts with a working session on (fuzz_worker.py).
HEALTHY_JOB_NAMES = JOB_NAMES[:3]
# More names for OpenSession, so that most opens do not find their job busy
# (jobs outside JOB_NAMES are deleted at the end of each example).
OPEN_JOB_NAMES = JOB_NAMES + [f"fz-{i}" for i in range(26)]
ODD_NAMES = ["", ".", "..", ".hidden", "../escape", "a/b", "/etc/passwd", "a" * 64, "a" * 65, "x" * 10000,
             "nul\x00byte", "\x1b[2J\x1b[31mred", "é", "job name", "manifest.tmp", "states.bin", "-", "_"]


def rarely(rare, common, one_in=10):
    """`rare` about once in `one_in` draws, `common` otherwise."""
    return st.integers(0, one_in - 1).flatmap(lambda i: rare if i == 0 else common)


# Wild values of each field type: an edge where arithmetic breaks, or anything.
def wild_u32():
    return st.one_of(st.sampled_from(U32_EDGES), st.integers(0, U32_MAX))


def wild_u64():
    return st.one_of(st.sampled_from(U64_EDGES), st.integers(0, U64_MAX))


def wild_i64():
    return st.one_of(st.sampled_from(I64_EDGES), st.integers(I64_MIN, I64_MAX))


def f32():
    return st.one_of(st.sampled_from(F32_EDGES), st.floats(width=32, allow_nan=True, allow_infinity=True))


def wild_enum():
    """A proto3 enum may carry any int32; 0 is UNSPECIFIED."""
    return st.one_of(st.just(0), st.integers(-(2**31), 2**31 - 1))


@st.composite
def message(draw, cls, sane, wild, max_wild=2):
    """A `cls` with every field drawn from `sane`, then 0 to `max_wild` fields
    redrawn from `wild`: mostly valid messages with one or two hostile values,
    which reach further into the daemon than messages hostile everywhere."""
    fields = {name: draw(strategy) for name, strategy in sane.items()}
    for _ in range(draw(st.integers(0, max_wild))):
        name = draw(st.sampled_from(sorted(wild)))
        fields[name] = draw(wild[name])
    return cls(**fields)


def text_field(max_size=80):
    return st.one_of(st.text(max_size=max_size), st.sampled_from(ODD_NAMES))


# Draws that pick from something the daemon returned (sessions, job names) have
# one shape whatever its size: hypothesis replays choices and insists that the
# same choices make the same draws. So: an index, reduced modulo the pool's size.
def index():
    return st.integers(0, 2**16 - 1)


def choose(pool, i):
    return pool[i % len(pool)]


def job_name(seen=()):
    """One of the fuzzer's own job names or of `seen` (names ListJobs showed),
    now and then anything."""
    pool = JOB_NAMES + sorted(seen)
    return rarely(text_field(), index().map(lambda i: choose(pool, i)), 4)


def client_info():
    # Now and then up to just under and just over gRPC's 4 MiB message limit.
    return rarely(st.sampled_from(["x" * 100_000, "y" * ((4 << 20) - 4096), "z" * (5 << 20)]), text_field(200))


def hyper():
    sane = dict(lr=st.sampled_from([1e-3, 1e-2]), beta1=st.just(0.9), beta2=st.just(0.999), eps=st.just(1e-8),
                weight_decay=st.sampled_from([0.0, 0.01]), grad_scale=st.sampled_from([0.0, 1.0, 0.5]))
    return message(pb.AdamWHyper, sane, {name: f32() for name in sane}, max_wild=3)


def chunk_spec():
    sane = dict(chunk_id=st.integers(0, 4), num_elements=st.integers(1, 4096), param_dtype=st.integers(1, 3),
                grad_dtype=st.integers(1, 3), slot=st.integers(0, 3))
    wild = dict(chunk_id=wild_u32(), num_elements=wild_u64(), param_dtype=wild_enum(), grad_dtype=wild_enum(),
                slot=wild_u32())
    # Fields that newer protos have (the pb2 modules come from the tree's protos).
    if "layout_fingerprint" in pb.ChunkSpec.DESCRIPTOR.fields_by_name:
        wild["layout_fingerprint"] = wild_u64()
    if "store_weights" in pb.ChunkSpec.DESCRIPTOR.fields_by_name:
        sane["store_weights"] = st.booleans()
        wild["store_weights"] = st.booleans()
    return message(pb.ChunkSpec, sane, wild)


@st.composite
def many_chunk_specs(draw):
    """60 to 300 chunk specs from one drawn seed: hypothesis has 8 KiB of choices
    per example, which a list this long drawn field by field would use up."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    count = draw(st.integers(60, 300))

    def pick(edges, sane):
        return rng.choice(edges) if rng.random() < 0.3 else rng.randint(*sane)

    return [pb.ChunkSpec(chunk_id=pick(U32_EDGES, (0, 400)), num_elements=pick(U64_EDGES, (1, 4096)),
                         param_dtype=rng.randint(0, 3), grad_dtype=rng.randint(0, 3), slot=pick(U32_EDGES, (0, 3)))
            for _ in range(count)]


def open_request():
    sane = dict(job=st.sampled_from(OPEN_JOB_NAMES), num_slots=st.integers(1, 4),
                slot_bytes=st.one_of(st.sampled_from([4096, 8192, 65536]), st.integers(1, 1 << 16)),
                client_info=st.text(max_size=20))
    # Sizes whose products with the slot count wrap 64 bits, and those that round
    # up past 2^64: a dictionary, as fuzzers have, beside any value.
    wrapping = st.sampled_from([2**63, 2**63 + 1, 2**62, 2**62 + 1, 2**61 + 1, 2**57, 2**64 - 4096, 2**64 - 4095,
                                2**64 - 1])
    wild = dict(job=text_field(), num_slots=wild_u32(), slot_bytes=st.one_of(wrapping, wild_u64()),
                client_info=client_info())
    return message(pb.OpenSessionRequest, sane, wild)


def stream_message(session_ids, step):
    """A ClientMessage of any kind. `step` is the session's next step (valid
    GradReady/EndStep need it); `session_ids` feed Attach."""
    pool = list(session_ids) or [""]
    ids = st.one_of(index().map(lambda i: choose(pool, i)), text_field())
    steps = st.one_of(st.just(step), st.integers(0, 4))
    state_sane = dict(chunk_id=st.integers(0, 4), which=st.integers(1, 3), slot=st.integers(0, 3),
                      first_element=st.integers(0, 2000), num_elements=st.integers(1, 2000))
    state_wild = dict(chunk_id=wild_u32(), which=wild_enum(), slot=wild_u32(), first_element=wild_u64(),
                      num_elements=wild_u64())
    grad_sane = dict(step=steps, chunk_id=st.integers(0, 4), slot=st.integers(0, 3), hyper=hyper())
    grad_wild = dict(step=wild_i64(), chunk_id=wild_u32(), slot=wild_u32())
    # The gradient journal (GradReady.journal, grad_ops), when the protos have it:
    # mostly real uses and a redo, now and then unknown enums and too many ops.
    if "journal" in pb.GradReady.DESCRIPTOR.fields_by_name:
        grad_sane.update(journal=st.integers(0, 3), redo=st.integers(0, 2),
                         grad_ops=st.lists(st.builds(pb.GradOp, kind=st.integers(1, 2),
                                                     operand=st.sampled_from([0.5, 2.0, 1024.0])), max_size=2))
        grad_wild.update(journal=wild_enum(), redo=wild_enum(),
                         grad_ops=st.lists(st.builds(pb.GradOp, kind=wild_enum(), operand=f32()), max_size=70))
    step_only = (dict(step=steps), dict(step=wild_i64()))
    fetches = []
    if "fetch_weights" in pb.ClientMessage.DESCRIPTOR.fields_by_name:
        fetches.append(message(pb.FetchWeights, dict(chunk_id=st.integers(0, 4), slot=st.integers(0, 3)),
                               dict(chunk_id=wild_u32(), slot=wild_u32())).map(
                                   lambda m: pb.ClientMessage(fetch_weights=m)))
    if "wait_durable" in pb.ClientMessage.DESCRIPTOR.fields_by_name:
        fetches.append(message(pb.WaitDurable, *step_only, max_wild=1).map(
            lambda m: pb.ClientMessage(wait_durable=m)))
    return st.one_of(
        *fetches,
        st.builds(lambda s: pb.ClientMessage(attach=pb.Attach(session_id=s)), ids),
        message(pb.GradReady, grad_sane, grad_wild).map(lambda m: pb.ClientMessage(grad_ready=m)),
        message(pb.EndStep, *step_only, max_wild=1).map(lambda m: pb.ClientMessage(end_step=m)),
        message(pb.AbortStep, *step_only, max_wild=1).map(lambda m: pb.ClientMessage(abort_step=m)),
        message(pb.ReadState, state_sane, state_wild).map(lambda m: pb.ClientMessage(read_state=m)),
        message(pb.WriteState, state_sane, state_wild).map(lambda m: pb.ClientMessage(write_state=m)),
        message(pb.SetUpdateCount, dict(chunk_id=st.integers(0, 4), update_count=st.integers(0, 10)),
                dict(chunk_id=wild_u32(), update_count=wild_i64())).map(
                    lambda m: pb.ClientMessage(set_update_count=m)),
        message(pb.CommitImport, dict(resume_step=st.integers(0, 10)), dict(resume_step=wild_i64()),
                max_wild=1).map(lambda m: pb.ClientMessage(commit_import=m)),
        st.just(pb.ClientMessage()),  # no kind set
    )


# --- byte-level mutation ---------------------------------------------------

def _varint(n):
    out = bytearray()
    n &= U64_MAX
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


# Fields that lie: a length-delimited field with a huge length, a varint of ten
# 0xff bytes, an unknown field number, a group start without its end.
LYING_FIELDS = [
    _varint((2 << 3) | 2) + _varint(2**31),
    _varint((2 << 3) | 2) + _varint(U64_MAX),
    _varint((1 << 3) | 0) + b"\xff" * 10,
    _varint((536870911 << 3) | 0) + _varint(1),
    _varint((3 << 3) | 3),
    _varint((4 << 3) | 5) + b"\x00\x00\xc0\x7f",  # fixed32 NaN in a varint field
    _varint((2 << 3) | 2) + _varint(3) + b"\xc3\x28\xa0",  # invalid UTF-8 in a string
]


@st.composite
def mutated(draw, valid):
    """Bytes derived from the serialized message `valid` by a few random edits.
    Each edit is three draws of fixed shape (what, where, a seed for the rest)."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "lie", "duplicate", "random"]))
        pos = draw(index()) % (len(data) + 1)
        rng = random.Random(draw(st.integers(0, 2**32 - 1)))
        if op == "flip" and data:
            data[min(pos, len(data) - 1)] ^= 1 << rng.randrange(8)
        elif op == "set" and data:
            data[min(pos, len(data) - 1)] = rng.choice([0x00, 0x7F, 0x80, 0xFF])
        elif op == "insert":
            data[pos:pos] = rng.randbytes(rng.randint(1, 16))
        elif op == "delete":
            del data[pos:pos + rng.randint(1, 8)]
        elif op == "truncate":
            del data[pos:]
        elif op == "lie":
            data[pos:pos] = rng.choice(LYING_FIELDS)
        elif op == "duplicate":
            data += bytes(data)
        elif op == "random":
            data = bytearray(rng.randbytes(rng.randint(0, 64)))
    return bytes(data)
