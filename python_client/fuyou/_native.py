"""Loads the C++ binding fuyou._fuyou with an actionable error when it is missing."""

from __future__ import annotations

import importlib

_module = None


def module():
    global _module
    if _module is None:
        try:
            _module = importlib.import_module("fuyou._fuyou")
        except ImportError as e:
            raise ImportError(
                "fuyou's C++ binding (fuyou/_fuyou*.so) is not built or does not load: "
                f"{e}. Build it with `cmake -S . -B build -G Ninja && ninja -C build _fuyou` "
                "from the repository root (it is written into python_client/fuyou/).") from e
    return _module
