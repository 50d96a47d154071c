"""Byte sizes written as the daemon's flags write them ("64MiB", "1.5GiB",
"1073741824"): the same units as ParseByteSize in daemon/config/daemon_config.h."""

from __future__ import annotations

import re
from typing import Union

__all__ = ["parse_size"]

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "k": 10 ** 3, "kb": 10 ** 3, "m": 10 ** 6, "mb": 10 ** 6, "g": 10 ** 9, "gb": 10 ** 9,
          "t": 10 ** 12, "tb": 10 ** 12}
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([a-z]*)")


def parse_size(value: Union[int, str], what: str = "size") -> int:
    """Bytes from an int (>= 0) or a string: a number (a fraction allowed) and a
    binary (KiB, MiB, GiB, TiB) or decimal (KB/K, MB/M, GB/G, TB/T) unit, case and
    spaces ignored. ValueError names `what` and the text otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be bytes or a size such as '64MiB', not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what} must be >= 0 bytes, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"{what} must be bytes or a size such as '64MiB', not {value!r}")
    text = "".join(value.split()).lower()
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ValueError(f"{what} {value!r} is not a size (examples: 64MiB, 1.5GiB, 1073741824)")
    factor = _UNITS.get(m.group(2))
    if factor is None:
        raise ValueError(f"{what} {value!r} has an unknown unit {m.group(2)!r} "
                         "(use KiB, MiB, GiB, TiB or KB, MB, GB, TB)")
    return int(round(float(m.group(1)) * factor))
