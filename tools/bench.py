#!/usr/bin/env python
"""Benchmarks: reshard against the copy limit of this disk, measured in the same run.

    python tools/bench.py make DIR [--params 170e6] [--dp 8] [--stage 3] [--dtype bf16]
        Train a stack of Linear layers one step with the real DeepSpeed engine (torchrun, CPU,
        gloo, ZeRO-3 params built partitioned) and save a checkpoint of about 12 bytes/param.
    python tools/bench.py make-synthetic DIR [the options of make]
        The checkpoint `make` would save, written by reshard's DeepSpeed writer without training
        (random tensor bytes): sizes whose model would not fit in RAM.
    python tools/bench.py compare REAL SYNTHETIC
        Check that a `make-synthetic` checkpoint has the files, keys, dtypes and shapes of a real one.
    python tools/bench.py run SRC [--to dp=4 --to dp=3] [--export] [--universal] [--dcp] [--repeat 3] [--json out.json]
        Alternate `cp -r SRC` (+ sync), `reshard convert SRC --to ...` and, with --export,
        `reshard export` and DeepSpeed's zero_to_fp32; with --universal, `convert --format universal`
        and DeepSpeed's ds_to_universal; with --dcp, `convert --format dcp`, and `reshard export
        --with-optimizer` of that DCP against torch's dcp_to_torch (caches dropped before each run
        when permitted); median of --repeat runs; print wall time, ratio to cp, bytes read and written
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

import torchrun_jobs

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


# ------------------------------------------------------------------------------------------ make
def make(args):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [__file__, "worker", args.dir, "--params", str(args.params), "--stage", str(args.stage), "--dtype", args.dtype]
    start = time.perf_counter()
    proc = torchrun_jobs.launch(args.dp, cmd, env, timeout=None, log=print)
    if proc.returncode != 0:
        sys.exit(f"{proc.stdout}{proc.stderr}\nbench make: the engine run failed (exit {proc.returncode})")
    print(f"made {args.dir} in {time.perf_counter() - start:.0f} s: {_du(args.dir) / 1e9:.2f} GB")


HIDDEN = 4096


def engine_config(stage, dtype):
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def worker(args):
    torchrun_jobs.run_rank(_train_and_save, args)      # exits


def _train_and_save(args):
    import deepspeed
    import torch
    import torch.nn as nn

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    hidden = HIDDEN
    layers = max(1, round(float(args.params) / hidden ** 2))
    config = engine_config(args.stage, args.dtype)
    with deepspeed.zero.Init(config_dict_or_path=config, enabled=args.stage == 3):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(hidden, hidden, bias=False) for _ in range(layers)])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(1, hidden, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(args.dir)


# ------------------------------------------------------------------------------- make-synthetic
def make_synthetic(args):
    """The checkpoint `make` would save for this model, written by reshard's DeepSpeed writer.

    The real engine needs ~24 GB of RAM for 800 M parameters on 8 ranks; this needs none. Tensor
    bytes are random (one 64 MiB block, reused); everything else is what the engine writes, which
    `compare` checks against a real `make` checkpoint of the same size.
    """
    import numpy as np

    import deepspeed
    from reshard.catalog import MASTER, Catalog, Fragment, LogicalTensor, ParamInfo, ScalarTensor, TrainingState
    from reshard.formats.deepspeed.notes import DeepSpeedNotes
    from reshard.executor import execute
    from reshard.formats import standins, writer
    from reshard.formats.torchzip import Storage
    from reshard.layout import Layout
    from reshard.planner import plan

    layers = max(1, round(float(args.params) / HIDDEN ** 2))
    work = tempfile.mkdtemp(prefix="reshard-synthetic-", dir=os.path.dirname(os.path.abspath(args.dir)))
    block = os.path.join(work, "src", "global_step1", "random.bin")
    os.makedirs(os.path.dirname(block))
    with open(block, "wb") as f:
        f.write(np.random.default_rng(0).bytes(HIDDEN * HIDDEN * 4))
    states = ["exp_avg", "exp_avg_sq"]
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[args.dtype]
    catalog = Catalog(root=os.path.dirname(block), format="deepspeed",
                      layout=Layout(dp=args.dp, zero=args.stage, dtype=dtype,
                                    options={"sub_group_size": 1_000_000_000}))
    scaler = standins.LossScaler()
    scaler.__dict__.update(cur_scale=1.0, dynamic=False)
    catalog.training = TrainingState(global_steps=1, global_samples=args.dp, skipped_steps=0)
    catalog.notes = DeepSpeedNotes(ds_config=engine_config(args.stage, args.dtype), ds_version=deepspeed.__version__,
                                   loss_scaler=scaler)
    names = [f"{i}.weight" for i in range(layers)]
    storage = Storage(block, 0, HIDDEN * HIDDEN * 4, "float32")
    for name in names:
        catalog.params[name] = ParamInfo(name, (HIDDEN, HIDDEN), "trainable", 0)
        catalog.order.append(name)
        for state in [MASTER, *states]:
            tensor = catalog.add(LogicalTensor(name, state, (HIDDEN, HIDDEN), "float32"))
            tensor.fragments.append(Fragment(0, HIDDEN * HIDDEN, storage, 0))
    hyper = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
             "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": True}
    catalog.param_groups.append({**hyper, "params": names})
    catalog.group_scalars.append({"step": ScalarTensor(1.0, "float32")})
    target = catalog.layout
    targets = writer("deepspeed").target_files(catalog, target, "global_step1")
    start = time.perf_counter()
    execute(plan(catalog, target, targets, "global_step1"), args.dir, progress=False)
    shutil.rmtree(work)
    script = os.path.join(os.path.dirname(deepspeed.__file__), "utils", "zero_to_fp32.py")
    shutil.copy(script, os.path.join(args.dir, "zero_to_fp32.py"))
    os.remove(os.path.join(args.dir, "reshard-manifest.json"))
    print(f"made {args.dir} in {time.perf_counter() - start:.0f} s: {_du(args.dir) / 1e9:.2f} GB")


def compare(args):
    """Same files, same pickled trees (keys, values, tensor dtypes and shapes) as a real checkpoint."""
    from reshard.formats import torchzip
    from reshard.formats.deepspeed.files import resolve_tag_dir

    real, synthetic = resolve_tag_dir(args.real)[0], resolve_tag_dir(args.synthetic)[0]
    names = sorted(os.listdir(real))
    problems = [] if names == sorted(os.listdir(synthetic)) else [f"files differ: {names} vs {sorted(os.listdir(synthetic))}"]
    for name in names:
        if os.path.exists(os.path.join(synthetic, name)):
            _same_tree(torchzip.load(os.path.join(real, name)), torchzip.load(os.path.join(synthetic, name)),
                       name, problems)
    print("\n".join(problems) if problems else f"same structure: {len(names)} files, every key, dtype and shape")
    return 1 if problems else 0


def _same_tree(a, b, where, problems):
    from reshard.formats.torchzip import TensorRef
    if isinstance(a, TensorRef):
        if not isinstance(b, TensorRef) or (a.dtype, a.shape) != (b.dtype, b.shape):
            problems.append(f"{where}: {a} vs {b}")
    elif isinstance(a, dict):
        if list(a) != list(b):
            problems.append(f"{where}: keys {list(a)} vs {list(b)}")
        for k in a:
            if k in b and k not in ("ds_config",):    # the real run's config has the same keys
                _same_tree(a[k], b[k], f"{where}.{k}", problems)
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            problems.append(f"{where}: {len(a)} vs {len(b)} items")
        for i, (x, y) in enumerate(zip(a, b)):
            _same_tree(x, y, f"{where}[{i}]", problems)
    elif type(a) is not type(b) or (a != b and not (isinstance(a, float) and where.endswith(("lr",)))):
        problems.append(f"{where}: {a!r} vs {b!r}")


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
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
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
        commands["convert universal"] = lambda dst: reshard + ["convert", src, dst, "--format", "universal", "--quiet"]
        commands["ds_to_universal"] = lambda dst: [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                                                   "--input_folder", tag_dir, "--output_folder", dst,
                                                   "--inject_missing_state"]
    if args.dcp:
        # the DCP source for the export comparison is made once, untimed
        dcp_src = os.path.join(work, "dcp-source")
        subprocess.run(reshard + ["convert", src, dcp_src, "--format", "dcp", "--quiet"], check=True)
        commands["convert dcp"] = lambda dst: reshard + ["convert", src, dst, "--format", "dcp", "--quiet"]
        # both write model and optimizer state: dcp_to_torch consolidates everything the DCP holds
        commands["export from dcp"] = lambda dst: reshard + ["export", dcp_src, dst, "--with-optimizer", "--quiet"]
        commands["dcp_to_torch_save"] = lambda dst: [sys.executable, "-m", "torch.distributed.checkpoint.format_utils",
                                                     "dcp_to_torch", dcp_src, dst + ".pt"]
    samples = {name: [] for name in commands}
    cold = True
    try:
        for _ in range(args.repeat):
            for name, make_cmd in commands.items():     # alternate: the disk drifts between runs
                dst = os.path.join(work, "out")
                cold = _drop_caches() and cold
                samples[name].append(_measure(make_cmd(dst)))
                for leftover in (dst, dst + ".safetensors", dst + ".pt"):
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
    pairs = (("export fp32", "zero_to_fp32"), ("convert universal", "ds_to_universal"),
             ("export from dcp", "dcp_to_torch_save")) + tuple((f"convert {t}", "ds_to_universal") for t in args.to)
    for ours, theirs in pairs:
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for name, what in (("make", "train a stack of Linear layers one step with the real DeepSpeed engine and save it"),
                       ("make-synthetic", "write the checkpoint `make` would save, with reshard's writer (no training, "
                                          "no RAM for the model)")):
        m = sub.add_parser(name, help=what, description=what[0].upper() + what[1:] + ".")
        m.add_argument("dir", help="the save dir to create")
        m.add_argument("--params", type=float, default=170e6,
                       help="about how many parameters (4096x4096 layers; default 170e6)")
        m.add_argument("--dp", type=int, default=8, help="data-parallel ranks (default 8)")
        m.add_argument("--stage", type=int, default=3, help="ZeRO stage (default 3)")
        m.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="training precision (default bf16)")
    what = "check that a synthetic checkpoint has the files and pickled structure of a real one of the same size"
    c = sub.add_parser("compare", help=what, description=what[0].upper() + what[1:] + ".")
    c.add_argument("real", help="a save dir written by `make`")
    c.add_argument("synthetic", help="a save dir written by `make-synthetic` with the same options")
    what = "one rank of `make` (started by torchrun; not for direct use)"
    w = sub.add_parser("worker", help=what, description=what[0].upper() + what[1:] + ".")
    w.add_argument("dir", help="the save dir")
    w.add_argument("--params", type=float, help="as for make")
    w.add_argument("--stage", type=int, help="as for make")
    w.add_argument("--dtype", help="as for make")
    what = "time reshard against cp -r (and DeepSpeed's and torch's own tools) on one checkpoint"
    r = sub.add_parser("run", help=what, description=what[0].upper() + what[1:] + ".")
    r.add_argument("src", help="the checkpoint (a DeepSpeed save dir)")
    r.add_argument("--to", action="append", default=None, metavar="SPEC",
                   help="a target topology to time `reshard convert --to SPEC` at; repeatable (default dp=4)")
    r.add_argument("--repeat", type=int, default=3, help="alternating runs of every command; the median is shown "
                   "(default 3)")
    r.add_argument("--workdir", help="where outputs go (default: beside the source)")
    r.add_argument("--export", action="store_true", help="also time `reshard export` and DeepSpeed's zero_to_fp32")
    r.add_argument("--universal", action="store_true",
                   help="also time `convert --format universal` and DeepSpeed's ds_to_universal")
    r.add_argument("--dcp", action="store_true",
                   help="also time `convert --format dcp`, and `reshard export` of that DCP against torch's dcp_to_torch")
    r.add_argument("--json", metavar="FILE", help="also write the figures to FILE as JSON")
    return p


def main():
    p = build_parser()
    args = p.parse_args()
    if args.cmd == "run" and not args.to:
        args.to = ["dp=4"]
    sys.exit({"make": make, "make-synthetic": make_synthetic, "compare": compare, "worker": worker,
              "run": run}[args.cmd](args))


if __name__ == "__main__":
    main()
