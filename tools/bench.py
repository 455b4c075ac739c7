#!/usr/bin/env python
"""Benchmarks: reshard against the copy limit of this disk, measured in the same run.

    python tools/bench.py make DIR [--params 170e6] [--dp 8] [--stage 3] [--dtype bf16]
        Train a stack of Linear layers one step with the real DeepSpeed engine (torchrun, CPU,
        gloo, ZeRO-3 params built partitioned) and save a checkpoint of about 12 bytes/param.
    python tools/bench.py run SRC [--to dp=4 --to dp=3] [--export] [--universal] [--repeat 3] [--json out.json]
        Alternate `cp -r SRC` (+ sync), `reshard convert SRC --to ...` and, with --export,
        `reshard export` and DeepSpeed's zero_to_fp32, with --universal DeepSpeed's ds_to_universal
        (caches dropped before each run when
        permitted); median of --repeat runs; print wall time, ratio to cp, bytes read and written
        (block I/O), and the peak RSS of each command's whole process tree.

Nothing here is asserted: it prints figures for people (see README's Performance section).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


# ------------------------------------------------------------------------------------------ make
def make(args):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc_per_node", str(args.dp), "--master_port", "29551", __file__, "worker", args.dir,
           "--params", str(args.params), "--stage", str(args.stage), "--dtype", args.dtype]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env)
    print(f"made {args.dir} in {time.perf_counter() - start:.0f} s: {_du(args.dir) / 1e9:.2f} GB")


def worker(args):
    import deepspeed
    import torch
    import torch.nn as nn

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    hidden = 4096
    layers = max(1, round(float(args.params) / hidden ** 2))
    # small sub-groups and no foreach: the optimizer step's temporaries stay small, so 8 ranks fit in RAM
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True, "foreach": False}},
              "zero_optimization": {"stage": args.stage, "sub_group_size": 10**7}, "steps_per_print": 10**9}
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    with deepspeed.zero.Init(config_dict_or_path=config, enabled=args.stage == 3):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(hidden, hidden, bias=False) for _ in range(layers)])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(1, hidden, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(args.dir)


# ------------------------------------------------------------------------------------------- run
def _drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _tree_rss(root: int) -> int:
    """Resident bytes of a process and all its descendants (the whole tree, summed)."""
    children, rss = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total


def _measure(cmd):
    """Wall seconds, peak RSS of the process tree (sampled), block I/O bytes read and written."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            stop.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    stop.set()
    sampler.join()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{stderr.decode()[-2000:]}")
    return {"seconds": wall, "peak_rss": max(peak[0], usage.ru_maxrss * 1024),
            "read": usage.ru_inblock * 512, "written": usage.ru_oublock * 512}


def run(args):
    src = os.path.abspath(args.src)
    size = _du(src)
    work = tempfile.mkdtemp(prefix="reshard-bench-", dir=args.workdir or os.path.dirname(src))
    reshard = [sys.executable, "-m", "reshard"]
    # the copy limit: cp -r, then sync, since reshard fsyncs what it writes
    commands = {"cp -r": lambda dst: ["sh", "-c", 'cp -r "$0" "$1" && sync', src, dst]}
    for spec in args.to:
        commands[f"convert {spec}"] = (lambda s: lambda dst: reshard + ["convert", src, dst, "--to", s, "--quiet"])(spec)
    if args.export:
        commands["export fp32"] = lambda dst: reshard + ["export", src, dst + ".safetensors", "--quiet"]
        script = os.path.join(src, "zero_to_fp32.py")
        commands["zero_to_fp32"] = lambda dst: [sys.executable, script, src, dst, "--safe_serialization"]
    if args.universal:
        with open(os.path.join(src, "latest")) as f:
            tag_dir = os.path.join(src, f.read().strip())
        commands["ds_to_universal"] = lambda dst: [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                                                   "--input_folder", tag_dir, "--output_folder", dst,
                                                   "--inject_missing_state"]
    samples = {name: [] for name in commands}
    cold = True
    try:
        for _ in range(args.repeat):
            for name, make_cmd in commands.items():     # alternate: the disk drifts between runs
                dst = os.path.join(work, "out")
                cold = _drop_caches() and cold
                samples[name].append(_measure(make_cmd(dst)))
                for leftover in (dst, dst + ".safetensors"):
                    if os.path.isdir(leftover):
                        shutil.rmtree(leftover)
                    elif os.path.exists(leftover):
                        os.remove(leftover)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(s["seconds"] for s in samples["cp -r"])
    table = []
    for name, runs in samples.items():
        row = {"command": name, "median_seconds": statistics.median(r["seconds"] for r in runs),
               "runs_seconds": [round(r["seconds"], 2) for r in runs],
               "peak_rss_mib": max(r["peak_rss"] for r in runs) / 2**20,
               "read_gb": statistics.median(r["read"] for r in runs) / 1e9,
               "written_gb": statistics.median(r["written"] for r in runs) / 1e9}
        row["ratio_to_cp"] = row["median_seconds"] / base
        row["gb_per_s"] = size / 1e9 / row["median_seconds"]
        table.append(row)
    by_name = {r["command"]: r for r in table}
    for ours, theirs in (("export fp32", "zero_to_fp32"),) + tuple((f"convert {t}", "ds_to_universal") for t in args.to):
        if ours in by_name and theirs in by_name:
            by_name[ours][f"ratio_to_{theirs}"] = by_name[ours]["median_seconds"] / by_name[theirs]["median_seconds"]
    print(f"source {src}: {size / 1e9:.2f} GB; {args.repeat} alternating runs; caches "
          f"{'dropped before each run' if cold else 'NOT dropped (no permission)'}")
    print(f"{'command':<20} {'median s':>9} {'x cp':>6} {'GB/s':>6} {'read GB':>8} {'written GB':>10} {'peak RSS MiB':>13}")
    for r in table:
        versus = ", ".join(f"{v:.2f}x {k[9:]}" for k, v in r.items() if k.startswith("ratio_to_") and k != "ratio_to_cp")
        print(f"{r['command']:<20} {r['median_seconds']:>9.2f} {r['ratio_to_cp']:>6.2f} {r['gb_per_s']:>6.2f} "
              f"{r['read_gb']:>8.2f} {r['written_gb']:>10.2f} {r['peak_rss_mib']:>13.0f}  {versus}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": src, "bytes": size, "cold": cold, "rows": table}, f, indent=1)


def _du(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("dir")
    m.add_argument("--params", type=float, default=170e6)
    m.add_argument("--dp", type=int, default=8)
    m.add_argument("--stage", type=int, default=3)
    m.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    w = sub.add_parser("worker")
    w.add_argument("dir")
    w.add_argument("--params", type=float)
    w.add_argument("--stage", type=int)
    w.add_argument("--dtype")
    r = sub.add_parser("run")
    r.add_argument("src")
    r.add_argument("--to", action="append", default=None)
    r.add_argument("--repeat", type=int, default=3)
    r.add_argument("--workdir", help="where outputs go (default: beside the source)")
    r.add_argument("--export", action="store_true", help="also time `reshard export` and DeepSpeed's zero_to_fp32")
    r.add_argument("--universal", action="store_true", help="also time DeepSpeed's ds_to_universal")
    r.add_argument("--json")
    args = p.parse_args()
    if args.cmd == "run" and not args.to:
        args.to = ["dp=4"]
    {"make": make, "worker": worker, "run": run}[args.cmd](args)


if __name__ == "__main__":
    main()
