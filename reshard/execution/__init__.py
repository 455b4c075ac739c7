"""Carrying out a plan: the executor and the bytes it writes (target_bytes; the source's are read through
reshard.reading), the staging folder and its journal, the output's manifest, progress, and the ranks of a torchrun
job sharing the work (distributed)."""
