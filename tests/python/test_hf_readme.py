"""The README's Hugging Face recipes run as they are written (issue 34): every
```python block of its "Hugging Face" section, each in a directory of its own,
in one fresh process whose fuyou.AdamW starts a private fuyoud (the user's
default: no daemon running)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")

from conftest import require_daemon  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SECTION = "### Hugging Face: `Trainer`, `accelerate`, PEFT, safetensors"


def readme_blocks() -> list:
    text = (ROOT / "README.md").read_text()
    start = text.index(SECTION)
    end = text.index("\n### ", start + len(SECTION))
    return re.findall(r"```python\n(.*?)```", text[start:end], flags=re.S)


@pytest.mark.slow
def test_the_readme_hugging_face_snippets_run(tmp_path):
    blocks = readme_blocks()
    assert len(blocks) == 4  # Trainer, accelerate, PEFT, safetensors
    runner = textwrap.dedent("""
        import os, sys
        blocks = {blocks!r}
        for i, code in enumerate(blocks):
            os.makedirs(f"snippet{{i}}")
            os.chdir(f"snippet{{i}}")
            exec(compile(code, f"README snippet {{i}}", "exec"), {{"__name__": "__main__"}})
            os.chdir("..")
            print(f"snippet {{i}} ran", flush=True)
    """).format(blocks=blocks)
    env = dict(os.environ, FUYOU_DAEMON=require_daemon(), FUYOU_DATA_DIR=str(tmp_path / "data"),
               FUYOU_SOCKET=str(tmp_path / "none.sock"), HF_HUB_OFFLINE="1",
               PYTHONPATH=str(ROOT / "python_client"))
    env.pop("FUYOU_EMBEDDED", None)
    done = subprocess.run([sys.executable, "-c", runner], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert done.stdout.count(" ran") == 4
    assert (tmp_path / "snippet0" / "out" / "checkpoint-4" / "optimizer.pt").is_file()
    assert (tmp_path / "snippet1" / "state").is_dir()
    assert (tmp_path / "snippet2" / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "snippet3" / "export" / "model.safetensors.index.json").is_file()
    assert (tmp_path / "snippet3" / "saved" / "model.safetensors").is_file()
