"""Round trip of one 64 MiB activation through the SSD tier of activation
offload (SpillActivation / RecallActivation, issue 23) on an embedded fuyoud
with one storage path; FUYOU_DAEMON names its binary. Prints MiB/s."""
import os, sys, tempfile, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python_client"))
import fuyou
from fuyou import _native
with tempfile.TemporaryDirectory() as tmp:
    d = fuyou.EmbeddedDaemon(data_dir=tmp + "/data", socket_path=tmp + "/d.sock",
                             extra_args=["--dram-budget", "256MiB"], binary=os.environ["FUYOU_DAEMON"])
    try:
        s = _native.module().Session.open(job="bench", num_slots=2, slot_bytes=4 << 20, address=d.address)
        data = bytearray(os.urandom(1 << 20)) * 64  # 64 MiB
        out = bytearray(len(data))
        t0 = time.perf_counter(); s.spill_activation(1, data); t1 = time.perf_counter()
        s.recall_activation(1, out); t2 = time.perf_counter()
        assert out == data
        print(f"spill 64 MiB: {64/ (t1-t0):.0f} MiB/s, recall: {64/(t2-t1):.0f} MiB/s")
        s.close()
    finally:
        d.stop()
