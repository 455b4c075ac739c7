"""A Hugging Face Llama into megatron-core: `reshard convert --format megatron` against Megatron-Bridge's own import.

Usage::

    python tools/bench_bridge.py HF_FOLDER --bridge-python VENV/bin/python --bridge-script bridge_import_cpu.py
                                 [--repeat 3] [--workdir DIR]

Megatron-Bridge 0.6.2 (with megatron-core 0.19.2) declares Python 3.12 and imports Transformer Engine; it runs on a
CPU under Python 3.11 only through a study script of shims (`../shared/reference/bridge_import_cpu.py`: its
docstring has the install recipe, a venv of its own), which `AutoBridge.from_hf_pretrained` → the megatron-core model
with the weights → `save_megatron_model(low_memory_save=True)`, as `AutoBridge.import_ckpt` does, at tp=1·pp=1. This
alternates, caches dropped before each run when permitted and reshard byte-compiled first: `cp -r` of the folder +
`sync`, that script (`--no-compare`: no forward), and `reshard convert HF_FOLDER OUT --format megatron --names
megatron-core-llama --to tp=1,pp=1`. Medians of wall and CPU seconds, the peak RSS of each process tree
(bench_run.measure); then reshard's reader opens both saves and every weight is compared bit for bit (Bridge writes
megatron-core 0.19's layout, reshard 0.16's). Nothing is asserted: it prints figures for people.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import bench_run
import torchrun_jobs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("hf", help="a Hugging Face Llama folder (safetensors)")
    p.add_argument("--bridge-python", required=True, help="the Python of Megatron-Bridge's own venv")
    p.add_argument("--bridge-script", required=True, help="the script that runs its import on a CPU")
    p.add_argument("--repeat", type=int, default=3, help="alternating runs of each; the median is shown (default 3)")
    p.add_argument("--workdir", help="where the outputs go (default: beside HF)")
    args = p.parse_args()
    hf = Path(args.hf).resolve()
    work = Path(tempfile.mkdtemp(prefix="reshard-bench-bridge-", dir=args.workdir or hf.parent))
    commands = {
        "cp -r + sync": lambda dst: ["sh", "-c", 'cp -r "$0" "$1" && sync', str(hf), dst],
        "Megatron-Bridge import": lambda dst: [args.bridge_python, args.bridge_script, "--hf", str(hf), "--out", dst,
                                               "--no-compare"],
        "reshard convert": lambda dst: [sys.executable, "-P", "-m", "reshard", "convert", str(hf), dst, "--format",
                                        "megatron", "--names", "megatron-core-llama", "--to", "tp=1,pp=1"],
    }
    bench_run.byte_compile()

    def free_port() -> None:        # the study script's process group takes MASTER_PORT: a free one, beside other jobs
        os.environ["MASTER_PORT"] = str(torchrun_jobs.free_port())
    try:
        samples, last, cold = bench_run.alternate(commands, str(work), args.repeat, before=free_port)
        same = _same_weights(Path(last["Megatron-Bridge import"]), Path(last["reshard convert"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size = bench_run.du(hf)
    print(f"{hf}: {size / 1e9:.2f} GB; {args.repeat} alternating runs; caches "
          f"{'dropped before each run' if cold else 'NOT dropped'}")
    bench_run.print_medians(samples, "cp -r + sync", size / 1e9, "read")
    print("the two saves' weights:", same)
    return 0


def _same_weights(bridge: Path, ours: Path) -> str:
    """'bit for bit equal (N tensors)' or what differs: every module tensor of the two saves, read by reshard."""
    import torch

    import reshard
    from reshard.core.catalog import MODULE
    left, right = reshard.open_checkpoint(str(bridge)), reshard.open_checkpoint(str(ours))

    def weights(catalog) -> dict:
        return {k.name: k for k in catalog.tensors if k.state == MODULE}
    a, b = weights(left), weights(right)
    if a.keys() != b.keys():
        return f"different names: {sorted(a.keys() ^ b.keys())[:6]}"
    unequal = []
    for name in sorted(a):
        x = reshard.full_tensor(left, a[name].name, a[name].state)
        y = reshard.full_tensor(right, b[name].name, b[name].state)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.reshape(-1).view(torch.uint8),
                                                                        y.reshape(-1).view(torch.uint8)):
            unequal.append(name)
    return f"bit for bit equal ({len(a)} tensors)" if not unequal else f"{len(unequal)} differ: {unequal[:6]}"


if __name__ == "__main__":
    raise SystemExit(main())
