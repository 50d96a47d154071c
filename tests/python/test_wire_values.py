"""The Python client's wire values (fuyou._protocol) are those of the binding,
which clientlib holds equal to offload.proto at compile time
(clientlib/src/proto_mirror.cc) and takes its limits from
proto/include/fuyou/wire_limits.h. `import fuyou` works without the binding, so
_protocol keeps literals; this test is what keeps them from drifting."""

import pytest

from conftest import native_available
from fuyou import _protocol

NAMES = ["STATE_MASTER", "STATE_EXP_AVG", "STATE_EXP_AVG_SQ", "REDO_GRADIENTS_CHANGED",
         "REDO_CLIPPED", "ABORT_SKIPPED_STEP", "ABORT_OVERFLOW", "JOURNAL_NONE", "JOURNAL_KEEP",
         "JOURNAL_ADD", "JOURNAL_REPLAY", "GRAD_OP_MUL", "GRAD_OP_DIV", "MAX_CHUNK_SEGMENTS",
         "MAX_SLOTS"]


@pytest.mark.skipif(not native_available(), reason="fuyou._fuyou binding not built")
@pytest.mark.parametrize("name", NAMES)
def test_protocol_value_is_the_bindings(name):
    import fuyou._fuyou as native
    assert getattr(_protocol, name) == getattr(native, name)


def test_every_exported_wire_value_is_checked():
    exported = {n for n in _protocol.__all__ if n.isupper()}
    assert exported == set(NAMES)
