"""Carrying out a plan: the executor and the bytes it reads (source_bytes: fragments of source files, CRC-checked
by checksums) and writes (target_bytes), the staging folder and its journal, the output's manifest, progress, and
the ranks of a torchrun job sharing the work (distributed)."""
