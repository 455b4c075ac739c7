"""verl's FSDP checkpoint into a Hugging Face folder: `reshard export` against verl's own `model_merger`.

Usage::

    python tools/bench.py verl-make DIR [--hidden 1024 --layers 16 --vocab 32000 --fsdp 2]
    python tools/bench.py verl DIR [--repeat 3]

`verl-make`: two CPU gloo ranks build a Qwen2 actor as verl's FSDP worker does (tools/verl_cpu.py), train it one step
and save it with verl 0.9.1's own `FSDPCheckpointManager` into `DIR/global_step_1/actor/` (weights and Adam's moments
in fp32, as verl's actor keeps them).

`verl`: alternates, caches dropped before each run when permitted, reshard byte-compiled first: `cp` of the ranks'
weights' files + `sync` (the bytes read), verl's `python -m verl.model_merger merge --backend fsdp` (which writes
bf16), and `reshard export --dtype bf16` into a Hugging Face folder. Medians of the wall and CPU seconds, the peak
RSS of each process tree (bench_run.measure), then whether the two folders hold the same tensors bit for bit. verl's
merger runs unmodified; only its package initialisers that import Ray are skipped (tools/verl_cpu.install), as in the
tests.
Nothing is asserted: it prints figures for people.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import bench_run
import torchrun_jobs

TOOLS = Path(__file__).resolve().parent
MERGE = ("import sys, verl_cpu; verl_cpu.install(); from verl.model_merger.__main__ import main; "
         "sys.argv[0] = 'model_merger'; main()")


def make(args) -> int:
    out = Path(args.dir).resolve()
    if out.exists():
        sys.exit(f"bench verl-make: {out} exists")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VERL_LOGGING_LEVEL": "WARNING",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TOOLS), os.environ.get("PYTHONPATH")]))}
    shape = json.dumps({"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "fsdp": args.fsdp})
    proc = torchrun_jobs.launch(args.world, [__file__, out, "--shape", shape], env, timeout=args.timeout)
    if proc.returncode != 0:
        sys.exit(f"bench verl-make: the ranks failed:\n{proc.stderr[-3000:]}")
    print("wrote", out, f"({bench_run.du(out) / 1e9:.2f} GB)")
    return 0


def worker(args) -> None:
    torchrun_jobs.run_rank(_train_and_save, Path(args.dir), json.loads(args.shape))


def _train_and_save(out: Path, shape: dict) -> None:
    import verl_cpu
    verl_cpu.install()
    import torch.distributed as dist
    from transformers import Qwen2Config
    dist.init_process_group("gloo")
    heads = shape["hidden"] // 64
    config = Qwen2Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                         intermediate_size=shape["hidden"] * 11 // 4, num_hidden_layers=shape["layers"],
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                         max_position_embeddings=2 * verl_cpu.SEQ, tie_word_embeddings=False,
                         architectures=["Qwen2ForCausalLM"])
    model, optimizer, scheduler, manager = verl_cpu.actor(shape["fsdp"], model_config=config)
    verl_cpu.train_step(model, optimizer, scheduler, 1, dist.get_rank())
    manager.save_checkpoint(str(out / "global_step_1" / "actor"), global_step=1)
    dist.barrier()
    if dist.get_rank() == 0:
        (out / "latest_checkpointed_iteration.txt").write_text("1")


def run(args) -> int:
    actor = Path(args.dir).resolve() / "global_step_1" / "actor"
    work = Path(tempfile.mkdtemp(prefix="reshard-bench-verl-", dir=args.workdir or actor.parent.parent.parent))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TOOLS), os.environ.get("PYTHONPATH")]))}
    os.environ.update(env)      # measure() hands its environment (and PYTHONPATH) to each command
    weights = sorted(str(p) for p in actor.glob("model_world_size_*_rank_*.pt"))
    read_bytes = sum(os.path.getsize(p) for p in weights)
    commands = {
        "cp of the weights' files + sync": lambda dst: ["sh", "-c", 'mkdir -p "$0" && cp "$@" "$0"/ && sync', dst,
                                                         *weights],
        "verl model_merger (bf16)": lambda dst: [sys.executable, "-c", MERGE, "merge", "--backend", "fsdp",
                                                  "--local_dir", str(actor), "--target_dir", dst],
        "reshard export --dtype bf16": lambda dst: [sys.executable, "-P", "-m", "reshard", "export", str(actor), dst,
                                                    "--dtype", "bf16"],
    }
    bench_run.byte_compile()
    try:
        samples, last, cold = bench_run.alternate(commands, str(work), args.repeat)
        same = _same_tensors(Path(last["verl model_merger (bf16)"]), Path(last["reshard export --dtype bf16"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{actor}: {bench_run.du(actor) / 1e9:.2f} GB, {len(weights)} weights' files of {read_bytes / 1e9:.2f} GB; "
          f"{args.repeat} alternating runs; caches {'dropped before each run' if cold else 'NOT dropped'}")
    bench_run.print_medians(samples, "cp of the weights' files + sync", read_bytes / 1e9, "read")
    print("the two folders' tensors:", same)
    return 0


def _same_tensors(a: Path, b: Path) -> str:
    """'bit for bit equal (N tensors)' or what differs, reading both folders' safetensors files."""
    import torch
    from safetensors import safe_open

    def tensors(folder: Path) -> dict:
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                out.update({k: st.get_tensor(k) for k in st.keys()})
        return out
    left, right = tensors(a), tensors(b)
    if left.keys() != right.keys():
        return f"different names: {sorted(left.keys() ^ right.keys())[:5]}"

    def raw(t):
        return t.contiguous().view(-1).view(torch.uint8)
    unequal = [k for k in left if left[k].dtype != right[k].dtype or left[k].shape != right[k].shape
               or not raw(left[k]).equal(raw(right[k]))]
    return f"bit for bit equal ({len(left)} tensors)" if not unequal else f"{len(unequal)} differ: {unequal[:5]}"


def add_parser(command) -> None:
    m = command("verl-make", "train a Qwen2 actor one step on CPU and save it with verl's own checkpoint manager")
    m.add_argument("dir", help="the run folder to create (DIR/global_step_1/actor/)")
    m.add_argument("--hidden", type=int, default=1024, help="hidden size, heads of 64 (default 1024)")
    m.add_argument("--layers", type=int, default=16, help="decoder layers (default 16)")
    m.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    m.add_argument("--fsdp", type=int, default=2, choices=[1, 2], help="FSDP version (default 2)")
    m.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    m.add_argument("--timeout", type=float, default=3600, help="seconds the ranks may take (default 3600)")
    r = command("verl", "time `reshard export` of a verl checkpoint against verl's model_merger and a copy of the "
                        "weights' files")
    r.add_argument("dir", help="a run folder `verl-make` wrote")
    r.add_argument("--repeat", type=int, default=3, help="alternating runs of each; the median is shown (default 3)")
    r.add_argument("--workdir", help="where the outputs go (default: beside DIR)")


COMMANDS = {"verl-make": make, "verl": run}


if __name__ == "__main__":     # a rank of `verl-make`, under torchrun
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--shape")
    worker(parser.parse_args())
