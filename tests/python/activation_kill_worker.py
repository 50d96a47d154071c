"""Worker for test_activations' killed-client test: spills a forward's
activations to the daemon's SSD tier through a session of its own, prints
"spilled <session_id>" and waits to be killed (its backward never runs)."""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python_client" / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fuyou  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402


def main():
    address = sys.argv[1]
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    handle = fuyou.offload_activations(model, plan="ssd", host_budget=0, min_bytes=0,
                                       ssd=address, verbose=False)
    data = torch.randint(0, 256, (4, 17))
    _, loss = model(data[:, :-1], data[:, 1:])
    handle.store.ssd.flush()  # every spill queued so far is written
    print(f"spilled {handle.store.ssd.session.session_id} {handle.store.ssd_bytes}", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
