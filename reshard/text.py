"""Words for people, shared by every message: counts with their nouns."""
from __future__ import annotations


def counted(n: int, noun: str) -> str:
    """`1 file`, `2 files`: a count with its noun, in the plural unless it is one."""
    return f"{n:,} {noun}{'s' * (n != 1)}"
