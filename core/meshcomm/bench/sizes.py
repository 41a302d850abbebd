"""Message sizes: ``"64MiB"`` → 67108864 and ``"8B:64MiB"`` → the sweep 8, 16, …, 64 MiB.

A sweep is ``LOW:HIGH[:FACTOR]``: sizes start at ``LOW`` and are multiplied by
``FACTOR`` (an integer ≥ 2, default 2, written ``4`` or ``x4``) while they stay below
``HIGH``; ``HIGH`` itself is always the last size, so ``8B:64MiB:4`` is 8 B, 32 B, …,
32 MiB, 64 MiB. A single size (``1MiB``) is a one-element sweep; several sweeps or sizes
can be joined with commas. Units are B, KiB/MiB/GiB (powers of 1024), KB/MB/GB (powers
of 1000) and K/M/G (read as KiB/MiB/GiB, as nccl-tests does); a bare number is bytes.
"""

from __future__ import annotations

import re

__all__ = ["parse_size", "parse_sizes", "format_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 1000,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 1000**2,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 1000**3,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
#: refuse sweeps that would allocate absurd buffers by mistake (a typo like 64GiB)
MAX_BYTES = 16 << 30


def parse_size(text: str) -> int:
    """Bytes in ``text`` (``"8"``, ``"8B"``, ``"4KiB"``, ``"1.5MiB"``); ValueError if malformed."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"size {text!r}: expected a number with an optional unit (B, KiB, MiB, GiB, KB, MB, GB)")
    unit = m.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(f"size {text!r}: unknown unit {m.group(2)!r} (use B, KiB, MiB, GiB, KB, MB or GB)")
    value = float(m.group(1)) * _UNITS[unit]
    if value != int(value):
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    if value > MAX_BYTES:
        raise ValueError(f"size {text!r} exceeds the limit of {format_size(MAX_BYTES)}")
    return int(value)


def _parse_factor(text: str) -> int:
    t = text.strip().lower().removeprefix("x").removeprefix("*")
    if not t.isdigit() or int(t) < 2:
        raise ValueError(f"sweep factor {text!r}: expected an integer >= 2 (e.g. 2, 4 or x4)")
    return int(t)


def parse_sizes(text: str) -> list[int]:
    """Sorted distinct sizes of ``text``: ``LOW:HIGH[:FACTOR]`` sweeps and single sizes, comma-joined."""
    sizes: set[int] = set()
    for part in text.split(","):
        if not part.strip():
            raise ValueError(f"sizes {text!r}: empty item")
        fields = part.split(":")
        if len(fields) == 1:
            sizes.add(parse_size(fields[0]))
            continue
        if len(fields) > 3:
            raise ValueError(f"sizes {part!r}: expected LOW:HIGH or LOW:HIGH:FACTOR")
        low, high = parse_size(fields[0]), parse_size(fields[1])
        factor = _parse_factor(fields[2]) if len(fields) == 3 else 2
        if low < 1:
            raise ValueError(f"sizes {part!r}: the lowest size must be at least 1 byte")
        if high < low:
            raise ValueError(f"sizes {part!r}: HIGH ({format_size(high)}) is below LOW ({format_size(low)})")
        s = low
        while s < high:
            sizes.add(s)
            s *= factor
        sizes.add(high)
    return sorted(sizes)


def format_size(nbytes: int) -> str:
    """The one size label of ``meshcomm bench`` and ``--compare``: ``8 B``, ``1 KiB``,
    ``1.5 KiB``, ``64 MiB``.

    The largest binary unit not above ``nbytes`` that states it exactly with at most two
    decimals; sizes no unit states exactly (``1008``, ``16380``: sizes rounded to split
    evenly over the ranks) are given in bytes, so a label never looks rounder than the
    buffer was.
    """
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div and (nbytes * 100) % div == 0:  # exact with at most two decimals
            return f"{nbytes / div:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{nbytes} B"
