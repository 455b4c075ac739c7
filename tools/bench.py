#!/usr/bin/env python
"""Benchmarks: reshard against the copy limit of this disk, measured in the same run.

    python tools/bench.py make DIR [--params 170e6] [--dp 8] [--stage 3] [--dtype bf16]
        Train a stack of Linear layers one step with the real DeepSpeed engine (torchrun, CPU,
        gloo, ZeRO-3 params built partitioned) and save a checkpoint of about 12 bytes/param.
    python tools/bench.py make-synthetic DIR [the options of make]
        The checkpoint `make` would save, written by reshard's DeepSpeed writer without training
        (random tensor bytes): sizes whose model would not fit in RAM.
    python tools/bench.py make-synthetic DIR --holes [the options of make]
        The same with every tensor byte zero and punched out as a hole: a source as large as memory on tmpfs
        for `fast` (reading a hole copies the kernel's zero page: a little cheaper than real bytes).
    python tools/bench.py make-synthetic DIR --sparse [--tp 8] [--pp 2] [--dp 2] [--layers 80]
        A Llama-70B-shaped Megatron-DeepSpeed pipeline (GPTModelPipe) at tp x pp, bf16 ZeRO-1, laid
        out by reshard's DeepSpeed writer, every header real and every tensor byte a hole: ~0.97 TB
        apparent, ~22 MB on disk (tools/bench_sparse.py). Read it with --layout-rules megatron-gpt.
    python tools/bench.py make-tp DIR [--tp 2] [--dp 1] [--layers 1] [--vocab 4096] [--intermediate 11008]
        A random Hugging Face Llama (hidden 4096, intermediate 11008, 32 heads / 8 key-value heads)
        trained one step by the real engine with AutoTP, bf16 ZeRO-1, saved to DIR/checkpoint (3.2 GB).
    python tools/bench.py make-moe DIR [--ep 2] [--stage 2]
        A random Hugging Face Mixtral (2 layers of 8 experts, hidden 512) trained one step by the real
        engine with AutoEP at ep 2 on 2 ranks, ZeRO-2 (or --stage) fp32 (0.44 GB).
    python tools/bench.py make-dcp DIR [--ranks 2] [--tensors 4]
        4096x11008 fp32 weights column-sharded (Shard(1)) over the ranks, with one Adam step's state,
        saved by torch's dcp.save (2.2 GB). Both run tools/bench_checkpoints.py under torchrun.
    python tools/bench.py thin SAVE_DIR [--tag global_step1] [--repeat 3] [--json out.json]
        `reshard thin --yes` of one checkpoint of a run (`make ... --saves 2`) against `cp` of the files it
        keeps + sync, caches dropped before each run when permitted, medians; peak RSS of each process tree
        (tools/bench_thin.py).
    python tools/bench.py fast SRC [--to dp=4] [--workers 2] [--repeat 3] [--workdir /dev/shm] [--json out.json]
        On tmpfs (fast storage: the CPU is the limit): `cp -r`, a direct copy, `reshard convert` with 1 and N
        workers (with --digest ALGORITHM: also that manifest digest), `export`, `validate --deep`; wall, x cp, CPU
        seconds and per GB, peak RSS of each process tree, the load beside them (tools/bench_fast.py).
    python tools/bench.py verl-make DIR [--hidden 1024] [--layers 16] [--fsdp 2]
    python tools/bench.py verl DIR [--repeat 3]
        A Qwen2 actor saved by verl's own checkpoint manager on 2 CPU ranks; then `reshard export --dtype bf16` of it
        against verl's `model_merger` and a copy of the weights' files, and the two outputs compared bit for bit
        (tools/bench_verl.py).
    python tools/bench.py compare REAL SYNTHETIC
        Check that a `make-synthetic` checkpoint has the files, keys, dtypes and shapes of a real one.
    python tools/bench.py run SRC [--to dp=4 --to dp=3] [--export] [--universal] [--dcp] [--repeat 3] [--json out.json]
        Alternate `cp -r SRC` (+ sync), `reshard convert SRC --to ...` and, with --export,
        `reshard export` and DeepSpeed's zero_to_fp32; with --universal, `convert --format universal`
        and DeepSpeed's ds_to_universal; with --dcp, `convert --format dcp`, and `reshard export
        --with-optimizer` of that DCP against torch's dcp_to_torch (caches dropped before each run
        when permitted); median of --repeat runs; print wall time, ratio to cp, bytes read and written
        (block I/O), and the peak RSS of each command's whole process tree. --format FMT writes the --to
        conversions in FMT; --layout-rules FILE goes to every reshard command; --inspect, --validate and
        --plan SPEC time those; --no-cp drops the copy (a sparse source); --reshard-only leaves out the
        other tools (tools/bench_run.py).

    python tools/bench.py make-hf DIR [--layers 12] [--hidden 1536] [--vocab 32000] [--dtype bf16]
        A random Hugging Face Llama made by transformers (save_pretrained, sharded with an index; 1.04 GB at the
        defaults), the source of `run DIR --format megatron --names megatron-core-llama --to tp=2,pp=2`; with
        --sparse, Llama 3 70B's shape as sparse files (~141 GB apparent), for `run DIR --no-cp --plan tp=8,pp=4`.

    Issue #13's benchmarks:
        bench.py make-tp /work/bench/tp2
        bench.py run /work/bench/tp2/checkpoint --to tp=1,dp=2 --to tp=2,dp=2 --to tp=8,dp=2,kv_heads=8 \
            --layout-rules llama-autotp --export --reshard-only
        bench.py make-dcp /work/bench/dcp2 --ranks 2
        bench.py run /work/bench/dcp2 --format deepspeed --to dp=2,zero=1 --export
        bench.py make-synthetic /work/bench/llama70b --sparse
        bench.py run /work/bench/llama70b --no-cp --inspect --validate --plan tp=4,pp=4,dp=2 \
            --layout-rules megatron-gpt

A checkpoint in an S3 bucket, converted straight from and to it against a download and a local convert:
tools/bench_s3.py (docs/object-storage.md); dcp.load from a bucket through reshard's Reader against
s3torchconnector and FsspecReader: tools/bench_s3_dcp.py. S3 clients compared: tools/bench_s3_clients.py.

Nothing here is asserted: it prints figures for people (see README's Performance section).
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import bench_fast
import bench_thin
import bench_verl
import torchrun_jobs
from bench_run import du, run

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


# ------------------------------------------------------------------------------------------ make
def make(args):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [__file__, "worker", args.dir, "--params", str(args.params), "--stage", str(args.stage),
           "--dtype", args.dtype, "--saves", str(getattr(args, "saves", 1))]
    start = time.perf_counter()
    proc = torchrun_jobs.launch(args.dp, cmd, env, timeout=None, log=print)
    if proc.returncode != 0:
        sys.exit(f"{proc.stdout}{proc.stderr}\nbench make: the engine run failed (exit {proc.returncode})")
    print(f"made {args.dir} in {time.perf_counter() - start:.0f} s: {du(args.dir) / 1e9:.2f} GB")


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
    for _ in range(args.saves or 1):        # one step, one save (a run of several: `thin` takes an older one)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(args.dir)


def _torchrun(world, args, what):
    """One engine run of tools/bench_checkpoints.py on WORLD ranks (CPU, gloo); exits on failure."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = torchrun_jobs.launch(world, [os.path.join(HERE, "bench_checkpoints.py"), *args], env, timeout=None,
                                log=print)
    if proc.returncode != 0:
        sys.exit(f"{proc.stdout}{proc.stderr}\nbench {what}: the engine run failed (exit {proc.returncode})")
    return time.perf_counter() - start


def make_tp(args):
    """A realistic-width AutoTP Llama checkpoint saved by the real engine (bench_checkpoints.py tp)."""
    seconds = _torchrun(args.tp * args.dp, ["tp", args.dir, args.tp, args.layers, args.vocab, args.intermediate],
                        "make-tp")
    print(f"made {args.dir}/checkpoint (tp={args.tp}, dp={args.dp}, kv_heads=8) in {seconds:.0f} s: "
          f"{du(args.dir) / 1e9:.2f} GB")


def make_moe(args):
    """An AutoEP Mixtral checkpoint saved by the real engine at ep = world (bench_checkpoints.py moe)."""
    seconds = _torchrun(args.ep, ["moe", args.dir, args.ep, args.stage], "make-moe")
    print(f"made {args.dir} (AutoEP Mixtral, ep={args.ep}, ZeRO-{args.stage} fp32) in {seconds:.0f} s: "
          f"{du(args.dir) / 1e9:.2f} GB")


def make_hf(args):
    """A LlamaForCausalLM of random weights (transformers' own initialization), saved by
    save_pretrained: the source of `convert --format megatron --names megatron-core-llama` (issue 42)."""
    import torch
    import transformers
    config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=12, num_key_value_heads=4,
                                      vocab_size=args.vocab, max_position_embeddings=4096, tie_word_embeddings=False)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    start = time.perf_counter()
    if args.sparse:
        import bench_hf_sparse
        total = bench_hf_sparse.make(args.dir)
        blocks = sum(os.stat(os.path.join(args.dir, f)).st_blocks * 512 for f in os.listdir(args.dir))
        print(f"{args.dir}: {total / 1e9:.1f} GB apparent, {blocks / 1e6:.1f} MB on disk")
        return
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(args.dir, max_shard_size=args.shard)
    print(f"{args.dir}: {du(args.dir) / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s")


def make_dcp(args):
    """A DCP checkpoint of column-sharded (Shard(1)) DTensors with Adam state, by dcp.save
    (bench_checkpoints.py dcp)."""
    seconds = _torchrun(args.ranks, ["dcp", args.dir, args.tensors], "make-dcp")
    print(f"made {args.dir} ({args.tensors} 4096x11008 fp32 weights, Shard(1) over {args.ranks} ranks) in "
          f"{seconds:.0f} s: {du(args.dir) / 1e9:.2f} GB")


# ------------------------------------------------------------------------------- make-synthetic
def make_synthetic(args):
    """The checkpoint `make` would save for this model, written by reshard's DeepSpeed writer.

    The real engine needs ~24 GB of RAM for 800 M parameters on 8 ranks; this needs none. Tensor
    bytes are random (one 64 MiB block, reused); everything else is what the engine writes, which
    `compare` checks against a real `make` checkpoint of the same size. With --sparse: a Llama-70B
    shaped tp x pp checkpoint instead, tensor bytes left as holes (tools/bench_sparse.py).
    """
    if args.sparse:
        return make_sparse(args)
    args.dp = args.dp or 8
    import deepspeed
    import numpy as np

    from reshard.core.catalog import (
        MASTER,
        CatalogBuilder,
        Fragment,
        ParamInfo,
        ScalarTensor,
        TensorDraft,
        TrainingState,
    )
    from reshard.core.layout import Layout
    from reshard.core.planner import plan
    from reshard.core.storage_ref import StorageRef
    from reshard.execution.executor import execute
    from reshard.formats import writer
    from reshard.formats.deepspeed import standins
    from reshard.formats.deepspeed.notes import DeepSpeedNotes
    from reshard.formats.deepspeed.topology import DeepSpeedTopology

    layers = max(1, round(float(args.params) / HIDDEN ** 2))
    work = tempfile.mkdtemp(prefix="reshard-synthetic-", dir=os.path.dirname(os.path.abspath(args.dir)))
    block = os.path.join(work, "src", "global_step1", "random.bin")
    os.makedirs(os.path.dirname(block))
    with open(block, "wb") as f:
        if args.holes:
            f.truncate(HIDDEN * HIDDEN * 4)
        else:
            f.write(np.random.default_rng(0).bytes(HIDDEN * HIDDEN * 4))
    states = ["exp_avg", "exp_avg_sq"]
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[args.dtype]
    catalog = CatalogBuilder(root=os.path.dirname(block), format="deepspeed",
                             layout=Layout.of(args.dp, dtype=dtype, format_topology=DeepSpeedTopology(
                                 zero=args.stage, sub_group_size=1_000_000_000)))
    scaler = standins.LossScaler()
    scaler.__dict__.update(cur_scale=1.0, dynamic=False)
    catalog.training = TrainingState(global_steps=1, global_samples=args.dp, skipped_steps=0)
    catalog.notes = DeepSpeedNotes(ds_config=engine_config(args.stage, args.dtype), ds_version=deepspeed.__version__,
                                   loss_scaler=scaler)
    names = [f"{i}.weight" for i in range(layers)]
    storage = StorageRef(block, 0, HIDDEN * HIDDEN * 4, "float32")
    for name in names:
        catalog.params[name] = ParamInfo(name, (HIDDEN, HIDDEN), "trainable", 0)
        catalog.order.append(name)
        for state in [MASTER, *states]:
            tensor = catalog.add(TensorDraft(name, state, (HIDDEN, HIDDEN), "float32"))
            tensor.fragments.append(Fragment(0, HIDDEN * HIDDEN, storage, 0))
    hyper = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
             "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": True}
    catalog.param_groups.append({**hyper, "params": names})
    catalog.group_scalars.append({"step": ScalarTensor(1.0, "float32")})
    source = catalog.freeze()
    target = source.layout
    targets = writer("deepspeed").target_files(source, target, "global_step1")
    start = time.perf_counter()
    execute(plan(source, target, targets, "global_step1"), args.dir, progress=False)
    shutil.rmtree(work)
    script = os.path.join(os.path.dirname(deepspeed.__file__), "utils", "zero_to_fp32.py")
    shutil.copy(script, os.path.join(args.dir, "zero_to_fp32.py"))
    os.remove(os.path.join(args.dir, "reshard-manifest.json"))
    if args.holes:      # the zero runs written become holes: the bytes read back are the same
        for folder, _, files in os.walk(args.dir):
            for name in files:
                subprocess.run(["fallocate", "--dig-holes", os.path.join(folder, name)], check=True)
    print(f"made {args.dir} in {time.perf_counter() - start:.0f} s: {du(args.dir) / 1e9:.2f} GB")


def make_sparse(args):
    import bench_sparse
    if os.path.isdir(args.dir) and os.listdir(args.dir):
        sys.exit(f"bench make-synthetic: {args.dir}: exists and is not empty")
    start = time.perf_counter()
    dp = args.dp or 2
    files, apparent = bench_sparse.make_sparse(args.dir, args.tp, args.pp, dp, args.layers)
    on_disk = int(subprocess.run(["du", "-s", "--block-size=1", args.dir], capture_output=True, text=True,
                                 check=True).stdout.split()[0])
    print(f"made {args.dir} (Llama-70B shapes, {args.layers} layers, tp={args.tp} pp={args.pp} dp={dp} ZeRO-1; "
          f"read it with --layout-rules {os.path.relpath(bench_sparse.RULES)}) in {time.perf_counter() - start:.0f} s: "
          f"{files} files, {apparent / 1e12:.3f} TB apparent, {on_disk / 2**20:.1f} MiB on disk")


def compare(args):
    """Same files, same pickled trees (keys, values, tensor dtypes and shapes) as a real checkpoint."""
    from reshard.formats.deepspeed import pickles as deepspeed_pickles
    from reshard.formats.deepspeed.files import resolve_tag_dir

    real, synthetic = resolve_tag_dir(args.real)[0], resolve_tag_dir(args.synthetic)[0]
    names = sorted(os.listdir(real))
    theirs = sorted(os.listdir(synthetic))
    problems = [] if names == theirs else [f"files differ: {names} vs {theirs}"]
    for name in names:
        if os.path.exists(os.path.join(synthetic, name)):
            _same_tree(deepspeed_pickles.load(os.path.join(real, name)),
                       deepspeed_pickles.load(os.path.join(synthetic, name)), name, problems)
    print("\n".join(problems) if problems else f"same structure: {len(names)} files, every key, dtype and shape")
    return 1 if problems else 0


def _same_tree(a, b, where, problems):
    from reshard.formats.torchsave_read import TensorRef
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
        for i, (x, y) in enumerate(zip(a, b, strict=False)):     # the common items, past a length problem
            _same_tree(x, y, f"{where}[{i}]", problems)
    elif type(a) is not type(b) or (a != b and not (isinstance(a, float) and where.endswith(("lr",)))):
        problems.append(f"{where}: {a!r} vs {b!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name, what):
        return sub.add_parser(name, help=what, description=what[0].upper() + what[1:] + ".")
    for name, what in (("make", "train a stack of Linear layers one step with the real DeepSpeed engine and save it"),
                       ("make-synthetic", "write the checkpoint `make` would save, with reshard's writer (no training, "
                                          "no RAM for the model)")):
        m = command(name, what)
        m.add_argument("dir", help="the save dir to create")
        m.add_argument("--params", type=float, default=170e6,
                       help="about how many parameters (4096x4096 layers; default 170e6)")
        m.add_argument("--dp", type=int, default=None if name == "make-synthetic" else 8,
                       help="data-parallel ranks (default 8; 2 with --sparse)")
        m.add_argument("--stage", type=int, default=3, help="ZeRO stage (default 3)")
        m.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="training precision (default bf16)")
        if name == "make":
            m.add_argument("--saves", type=int, default=1, help="steps, each saved (default 1; `thin` needs 2)")
    m.add_argument("--sparse", action="store_true",
                   help="a Llama-70B-shaped Megatron-DeepSpeed GPTModelPipe (tp x pp, ZeRO-1, bf16) as sparse files: "
                        "headers real, tensor bytes holes (~1 TB apparent, a few MB on disk); --params, --stage and "
                        "--dtype do not apply")
    m.add_argument("--holes", action="store_true",
                   help="the same checkpoint with every tensor byte zero and left a hole (fallocate --dig-holes): "
                        "10 GB of it holds a few MB of tmpfs, so `fast` can time a source as large as memory")
    m.add_argument("--tp", type=int, default=8, help="with --sparse: tensor-parallel degree (default 8)")
    m.add_argument("--pp", type=int, default=2, help="with --sparse: pipeline stages (default 2)")
    m.add_argument("--layers", type=int, default=80, help="with --sparse: decoder layers (default 80)")
    what = ("save a random HF Llama (hidden 4096, intermediate 11008, 32/8 heads) with the real engine's AutoTP, "
            "bf16 ZeRO-1")
    m = command("make-tp", what)
    m.add_argument("dir", help="the dir to create: DIR/checkpoint is the save dir, DIR/hf_config the model config")
    m.add_argument("--tp", type=int, default=2, help="autotp_size (default 2)")
    m.add_argument("--dp", type=int, default=1, help="data-parallel ranks (default 1)")
    m.add_argument("--layers", type=int, default=1, help="decoder layers (default 1)")
    m.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default 4096: 3.2 GB at one layer)")
    m.add_argument("--intermediate", type=int, default=11008,
                   help="MLP width (default 11008; 512 gives a narrow model: many short rows per row-parallel shard)")
    what = "save a random Hugging Face Llama with transformers' save_pretrained (no engine, no download)"
    m = command("make-hf", what)
    m.add_argument("dir", help="the model folder to create")
    m.add_argument("--layers", type=int, default=12, help="decoder layers (default 12: 1.04 GB in bf16)")
    m.add_argument("--hidden", type=int, default=1536, help="hidden size (default 1536; MLP 4x, 12/4 heads)")
    m.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    m.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="weights' dtype (default bf16)")
    m.add_argument("--shard", default="400MB", help="save_pretrained's max_shard_size (default 400MB: an index)")
    m.add_argument("--sparse", action="store_true", help="Llama 3 70B's shape as sparse files (tools/"
                   "bench_hf_sparse.py: real headers, the tensors' bytes holes; ~141 GB apparent); the other "
                   "options do not apply")
    what = "save column-sharded (Shard(1)) 4096x11008 fp32 DTensors with Adam state by torch's dcp.save"
    m = command("make-dcp", what)
    m.add_argument("dir", help="the DCP dir to create")
    m.add_argument("--ranks", type=int, default=2, help="ranks the tensors are cut over (default 2)")
    m.add_argument("--tensors", type=int, default=4, help="how many 4096x11008 weights (default 4)")
    what = "save a random HF Mixtral (hidden 512, 2 layers of 8 experts) with the real engine's AutoEP, fp32"
    m = command("make-moe", what)
    m.add_argument("dir", help="the save dir to create (0.44 GB)")
    m.add_argument("--ep", type=int, default=2, help="autoep_size, and the ranks it is trained on (default 2)")
    m.add_argument("--stage", type=int, default=2, choices=[1, 2, 3], help="ZeRO stage (default 2)")
    what = "check that a synthetic checkpoint has the files and pickled structure of a real one of the same size"
    c = command("compare", what)
    c.add_argument("real", help="a save dir written by `make`")
    c.add_argument("synthetic", help="a save dir written by `make-synthetic` with the same options")
    what = "one rank of `make` (started by torchrun; not for direct use)"
    w = command("worker", what)
    w.add_argument("dir", help="the save dir")
    w.add_argument("--params", type=float, help="as for make")
    w.add_argument("--stage", type=int, help="as for make")
    w.add_argument("--dtype", help="as for make")
    w.add_argument("--saves", type=int, help="as for make")
    bench_thin.add_parser(command)
    bench_fast.add_parser(command)
    bench_verl.add_parser(command)
    what = "time reshard against cp -r (and DeepSpeed's and torch's own tools) on one checkpoint"
    r = command("run", what)
    r.add_argument("src", help="the checkpoint (a DeepSpeed save dir)")
    r.add_argument("--to", action="append", default=None, metavar="SPEC",
                   help="a target topology to time `reshard convert --to SPEC` at; repeatable (default dp=4 when "
                        "nothing else is timed)")
    r.add_argument("--repeat", type=int, default=3, help="alternating runs of every command; the median is shown "
                   "(default 3)")
    r.add_argument("--workdir", help="where outputs go (default: beside the source)")
    r.add_argument("--export", action="store_true", help="also time `reshard export` and DeepSpeed's zero_to_fp32")
    r.add_argument("--universal", action="store_true",
                   help="also time `convert --format universal` and DeepSpeed's ds_to_universal")
    r.add_argument("--dcp", action="store_true",
                   help="also time `convert --format dcp`, and `reshard export` of that DCP against torch's "
                        "dcp_to_torch")
    r.add_argument("--format", help="the target format of the --to conversions (e.g. deepspeed, from a DCP source)")
    r.add_argument("--names", metavar="RULES", help="passed to the --to conversions (a Hugging Face model into "
                   "Megatron: --format megatron --names megatron-core-llama)")
    r.add_argument("--layout-rules", metavar="FILE", help="passed to every reshard command (a tensor-parallel re-cut "
                   "needs --layout-rules llama-autotp and kv_heads=K in its --to)")
    r.add_argument("--inspect", action="store_true", help="also time `reshard inspect`")
    r.add_argument("--validate", action="store_true", help="also time `reshard validate`")
    r.add_argument("--plan", action="append", default=[], metavar="SPEC",
                   help="also time `reshard plan --to SPEC`; repeatable")
    r.add_argument("--no-cp", action="store_true", help="no `cp -r` baseline (a sparse source: reading commands only)")
    r.add_argument("--reshard-only", action="store_true",
                   help="not DeepSpeed's or torch's own tools beside reshard's (zero_to_fp32, ds_to_universal, "
                        "dcp_to_torch)")
    r.add_argument("--max-rss", type=float, metavar="MIB", help="kill a command whose process tree passes MIB "
                   "MiB (its figures are then lower bounds, and it is not run again)")
    r.add_argument("--timeout", type=float, metavar="S", help="kill a command running past S seconds (likewise)")
    r.add_argument("--json", metavar="FILE", help="also write the figures to FILE as JSON")
    return p


def main():
    p = build_parser()
    args = p.parse_args()
    if args.cmd == "run":
        timed = args.to or args.inspect or args.validate or args.plan or args.export or args.universal or args.dcp
        args.to = args.to or ([] if timed else ["dp=4"])
    sys.exit({"make": make, "make-tp": make_tp, "make-hf": make_hf, "make-dcp": make_dcp, "make-moe": make_moe,
              "make-synthetic": make_synthetic, "compare": compare, "worker": worker, "run": run,
              "thin": bench_thin.run_thin, "fast": bench_fast.run_fast, **bench_verl.COMMANDS}[args.cmd](args))


if __name__ == "__main__":
    main()
