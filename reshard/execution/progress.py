"""Progress bars, on stderr and only when it is a terminal: a log or a pipe gets no `\\r` lines."""
from __future__ import annotations

import sys


def bar(total: int, desc: str, enabled: bool = True):
    """A tqdm bar counting bytes; `enabled=False` (--quiet, or a rank other than 0) shows nothing, and
    tqdm's `disable=None` shows nothing where stderr is not a terminal."""
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                disable=None if enabled else True, file=sys.stderr)
