"""How findings and notes name many things in a few words: positions as spans of consecutive ones, names as a list
cut short after the first few.
"""

from __future__ import annotations

NAMES_SHOWN = 8  # names a note or finding lists before "and N more"


def span(positions: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'"""
    parts, start = [], None
    for i, p in enumerate(positions):
        if start is None:
            start = p
        if i + 1 == len(positions) or positions[i + 1] != p + 1:
            parts.append(f"{start}" if start == p else f"{start}-{p}")
            start = None
    return ", ".join(parts)


def listed(names: list[str]) -> str:
    shown = ", ".join(names[:NAMES_SHOWN])
    return shown + (f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else "")
