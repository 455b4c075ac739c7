"""Command line: argument parsing and printing only; the work is in the library."""
from __future__ import annotations

import argparse
import json
import os
import sys

import reshard
from reshard.errors import ReshardError, UsageError
from reshard.inspect import human_bytes, jsonable

# A reader that closed our stdout (`reshard inspect X | head -1`) ends the command quietly with the
# status of a Unix tool killed by SIGPIPE, 128 + 13: `set -o pipefail` sees what it sees for `cat`.
EXIT_STDOUT_CLOSED = 141


def main(argv=None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()      # output still buffered meets a closed pipe here, not at interpreter exit
        return code
    except BrokenPipeError:
        # Python's recommended handling: point stdout at devnull so the flush at exit cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_STDOUT_CLOSED


def _main(argv) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:
        raise
    except UsageError as e:
        _error(args, str(e), e.file)
        return 2
    except ReshardError as e:
        _error(args, str(e), e.file)
        return getattr(args, "error_exit", 1)
    except OSError as e:       # an I/O failure no layer turned into a ReshardError: still one line
        _error(args, f"{e.filename or ''}: {e.strerror or e}", e.filename)
        return getattr(args, "error_exit", 1)
    except KeyboardInterrupt:
        print("reshard: interrupted", file=sys.stderr)
        return 130


def _error(args, message: str, file) -> None:
    """One line on stderr; with --json also {"error", "file"} on stdout. Under torchrun, from rank 0 only."""
    if os.environ.get("RANK", "0") != "0":
        return
    print(f"reshard: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        _dump({"error": message, "file": None if file is None else str(file)})


def _dump(data) -> None:
    json.dump(data, sys.stdout, indent=2)
    print()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reshard", description=(
        "Convert, export, inspect, validate and compare training checkpoints (DeepSpeed ZeRO, "
        "universal, PyTorch DCP, torch.save, Lightning, Hugging Face) without executing code from them."))
    parser.add_argument("--version", action="version", version=f"reshard {reshard.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("inspect", help="what a checkpoint holds: topology, dtypes, optimizer, files")
    _source_args(p)
    p.add_argument("--params", action="store_true", help="add a per-parameter table")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_inspect)

    p = sub.add_parser("validate", help="prove every element of every tensor is present exactly once "
                       "(exit 0 complete, 1 not, 2 usage)")
    _source_args(p)
    p.add_argument("--deep", action="store_true", help="also read the bytes and report NaN/Inf")
    p.add_argument("--checksums", action="store_true",
                   help="verify every file's sha256 against the reshard manifest (convert/export write one)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_validate)

    p = sub.add_parser("plan", help="what a conversion would read and write, without writing")
    _source_args(p)
    p.add_argument("--to", default="", metavar="SPEC",
                   help="target topology: dp=M[,zero=S][,tp=T][,pp=P][,partition=uniform|parameters] (unnamed keys "
                        "keep the source's; default: the source's topology, e.g. to change only --format) or a "
                        "layout file")
    p.add_argument("--tag-out", help="tag of the converted checkpoint (default: the source's)")
    p.add_argument("--format", dest="fmt", metavar="FORMAT",
                   help="target format: deepspeed (default for a DeepSpeed source), dcp, universal")
    p.add_argument("--dst", help="where the output would go (for the free-disk check)")
    p.add_argument("--memory-budget", default="512MiB", type=_size_arg, metavar="SIZE")
    p.add_argument("--workers", type=_positive_int, default=1, metavar="K")
    p.add_argument("--json", action="store_true", help="print the plan summary as JSON")
    p.set_defaults(run=_plan)

    p = sub.add_parser("convert", help="write the checkpoint for another topology (DeepSpeed resumes from it)")
    p.add_argument("path", metavar="SRC", help="a checkpoint: DeepSpeed save dir or tag folder, universal or DCP "
                   "directory, .pt/.pth/.bin, .ckpt, HF checkpoint folder, safetensors file or folder")
    p.add_argument("dst", metavar="DST", help="the new save dir (created; holds 'latest' and the tag folder)")
    p.add_argument("--to", default="", metavar="SPEC",
                   help="target topology: dp=M[,zero=S][,tp=T][,pp=P][,partition=uniform|parameters] (unnamed keys "
                        "keep the source's; default: the source's topology, e.g. to change only --format) or a "
                        "layout file")
    p.add_argument("--tag", help="the source tag (default: the one named in 'latest')")
    p.add_argument("--tag-out", help="tag of the converted checkpoint (default: the source's)")
    p.add_argument("--layout-rules", metavar="FILE",
                   help="how tensor parallelism cut each tensor, for a TP checkpoint that does not say (layouts/*.json)")
    p.add_argument("--format", dest="fmt", metavar="FORMAT",
                   help="target format: deepspeed (default for a DeepSpeed source), dcp, universal")
    p.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    p.add_argument("--workers", type=_positive_int, default=1, metavar="K", help="local processes writing files")
    p.add_argument("--memory-budget", default="512MiB", type=_size_arg, metavar="SIZE",
                   help="bound on copy buffers (default 512MiB)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty DST")
    p.add_argument("--resume", action="store_true",
                   help="after an interrupted run, keep the files it finished (checked by sha256)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print what was written (files, bytes, topology, manifest) "
                   "as JSON")
    p.set_defaults(run=_convert)

    p = sub.add_parser("export", help="one consolidated state dict: safetensors (or HF shards), or torch")
    p.add_argument("path", metavar="SRC", help="a checkpoint: DeepSpeed save dir or tag folder, universal or DCP "
                   "directory, .pt/.pth/.bin, .ckpt, HF checkpoint folder, safetensors file or folder")
    p.add_argument("out", metavar="OUT", help="a .safetensors (or .bin/.pt with --format torch) file, or a "
                   "directory for Hugging Face shards + index")
    p.add_argument("--tag", help="the source tag (default: the one named in 'latest')")
    p.add_argument("--layout-rules", metavar="FILE",
                   help="how tensor parallelism cut each tensor, for a TP checkpoint that does not say (layouts/*.json)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16", "auto"],
                   help="dtype of floating tensors (auto: the training precision); integer buffers keep theirs")
    p.add_argument("--max-shard-size", metavar="SIZE",
                   help="shard limit in huggingface_hub's units (5GB = 5e9 bytes; default 5GB in a directory)")
    p.add_argument("--with-optimizer", action="store_true",
                   help="also every optimizer state (one safetensors set per state) and optimizer.json")
    p.add_argument("--format", choices=["safetensors", "torch"],
                   help="default: torch for a .bin/.pt/.pth OUT, else safetensors")
    p.add_argument("--weights", default="master", choices=["master", "module"],
                   help="fp32 master copy (default) or the saved 16-bit module copy where there is one")
    p.add_argument("--memory-budget", default="512MiB", type=_size_arg, metavar="SIZE")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument("--resume", action="store_true",
                   help="after an interrupted run, keep the files it finished (checked by sha256)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print what was written (files, bytes, manifest) as JSON")
    p.set_defaults(run=_export)

    p = sub.add_parser("diff", help="compare two checkpoints of any formats and topologies, tensor by tensor "
                       "(exit 0 equal, 1 different, 2 trouble)")
    p.add_argument("a", metavar="A", help="a checkpoint (any format reshard reads)")
    p.add_argument("b", metavar="B", help="another checkpoint")
    p.add_argument("--tag-a", help="tag of A, for a DeepSpeed save dir")
    p.add_argument("--tag-b", help="tag of B, for a DeepSpeed save dir")
    p.add_argument("--layout-rules", metavar="FILE",
                   help="how tensor parallelism cut each tensor, for TP checkpoints that do not say (layouts/*.json)")
    p.add_argument("--atol", type=float, default=0.0, help="largest absolute difference still equal (default 0)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=_diff, error_exit=2)
    return parser


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def _size_arg(text: str) -> int:
    import re
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive whole number: {text!r}")
    return value


def _source_args(p):
    p.add_argument("path", metavar="PATH", help="a checkpoint: DeepSpeed save dir or tag folder, universal or DCP "
                   "directory, .pt/.pth/.bin, .ckpt, HF checkpoint folder, safetensors file or folder")
    p.add_argument("--tag", help="the tag folder to read (default: the one named in 'latest')")
    p.add_argument("--layout-rules", metavar="FILE",
                   help="how tensor parallelism cut each tensor, for a TP checkpoint that does not say (layouts/*.json)")


def _inspect(args) -> int:
    catalog = reshard.open_checkpoint(args.path, args.tag, args.layout_rules)
    info = reshard.inspect(catalog, params=args.params)
    if args.json:
        json.dump(jsonable(info), sys.stdout, indent=2)
        print()
    else:
        _print_inspect(info)
    if catalog.problems:    # what could be read is shown; the checkpoint is still not whole
        more = f" (and {len(catalog.problems) - 1} more; run `reshard validate`)" if len(catalog.problems) > 1 else ""
        print(f"reshard: {catalog.problems[0]}{more}", file=sys.stderr)
        return 1
    return 0


def _print_inspect(info) -> None:
    t = info["topology"]
    print(f"{info['path']}")
    print(f"  format        {info['format']} (tag {info['tag']})")
    print(f"  topology      dp={t['dp']} tp={t['tp']} pp={t['pp']} (world size {t['world_size']}), "
          f"ZeRO stage {info['zero_stage']}")
    print(f"  dtypes        model {info['dtype']}, master {info['master_dtype']}")
    print(f"  optimizer     {info['optimizer'] or '?'}: states {', '.join(info['optimizer_states']) or 'none'}")
    if info["options"]:
        print(f"  options       {', '.join(f'{k}={v}' for k, v in info['options'].items())}")
    print(f"  step          {info['step']} (global_steps {info['global_steps']}, "
          f"global_samples {info['global_samples']})")
    print(f"  parameters    {info['parameters']} ({info['elements']:,} elements): {info['trainable']} trainable, "
          f"{info['frozen']} frozen; {info['buffers']} buffers")
    for alias, source in info["aliases"].items():
        print(f"  tied          {alias} -> {source}")
    for g, group in enumerate(info["param_groups"]):
        hyper = ", ".join(f"{k}={v}" for k, v in group.items() if k != "params")
        print(f"  group {g:<7} {group['params']} params; {hyper}")
    for state, n in info["bytes_per_state"].items():
        print(f"  {state:<13} {human_bytes(n)}")
    print(f"  files         {len(info['files'])}, {human_bytes(sum(f['bytes'] for f in info['files']))}")
    for f in info["files"]:
        print(f"    {f['path']:<48} {human_bytes(f['bytes']):>10}")
    if info["problems"]:
        print(f"  problems      {info['problems']} (run `reshard validate`)")
    for row in info.get("parameter_table", []):
        shape = "x".join(map(str, row["shape"])) or "scalar"
        group = "" if row["group"] is None else f"group {row['group']}"
        tied = f"tied: {', '.join(row['tied_to_it'])}" if row["tied_to_it"] else ""
        where = f"tp {row['tensor_parallel']}" if "tensor_parallel" in row else ""
        if len(row.get("stages", [])) > 1:
            where = f"stages {','.join(map(str, row['stages']))}"
        print(f"    {row['name']:<32} {shape:<12} {row['kind']:<9} {row['dtype'] or '':<9} {group:<8} "
              f"{','.join(row['states'])} {tied} {where}".rstrip())


def _validate(args) -> int:
    report = reshard.validate(reshard.open_checkpoint(args.path, args.tag, args.layout_rules), deep=args.deep,
                              checksums=args.checksums)
    if args.json:
        json.dump(report.to_dict(), sys.stdout, indent=2)
        print()
    else:
        for problem in report.problems:
            print(problem)
        print(report.summary())
    return 0 if report.ok else 1


def _make_plan(args):
    from reshard.convert import make_plan
    catalog = reshard.open_checkpoint(args.path, args.tag, args.layout_rules)
    return catalog, make_plan(catalog, args.to, args.tag_out, args.fmt)


def _plan(args) -> int:
    catalog, plan = _make_plan(args)
    summary = _print_plan(catalog, plan, args.fmt, args.dst, args.memory_budget, args.workers, args.json)
    if not summary["disk_ok"]:
        print(f"reshard: {summary['free_disk_at']}: {human_bytes(summary['free_disk_bytes'])} free, the conversion "
              f"writes {human_bytes(plan.bytes_written)}", file=sys.stderr)
        return 1
    return 0


def _convert(args) -> int:
    from reshard.executor import execute
    catalog, plan = _make_plan(args)
    if args.dry_run:
        _print_plan(catalog, plan, args.fmt, args.dst, args.memory_budget, args.workers, args.json)
        return 0
    group = _group()
    try:
        written = execute(plan, args.dst, overwrite=args.overwrite, memory_budget=args.memory_budget,
                          workers=args.workers, progress=not args.quiet, resume=args.resume, group=group)
    finally:
        group.close()
    _print_written(args, args.dst, written)
    return 0


def _print_written(args, dst, written) -> None:
    """What is on disk now, as `validate --checksums` will find it (rank 0 only: the others return None)."""
    if written is None:
        return
    if args.json:
        _dump(written.to_dict())
    elif not args.quiet:
        count = len(written.files)
        print(f"wrote {dst} ({written.output.words()}): {count} file{'s' * (count != 1)}, "
              f"{human_bytes(written.size)}")


def _export(args) -> int:
    from reshard.executor import execute
    from reshard.export import export_plan
    from reshard.validate import require_complete
    catalog = reshard.open_checkpoint(args.path, args.tag, args.layout_rules)
    require_complete(catalog)
    plan, single_file = export_plan(catalog, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size,
                                    with_optimizer=args.with_optimizer, fmt=args.format, weights=args.weights)
    group = _group()
    try:
        written = execute(plan, args.out, overwrite=args.overwrite, memory_budget=args.memory_budget,
                          progress=not args.quiet, single_file=single_file, resume=args.resume, group=group)
    finally:
        group.close()
    _print_written(args, args.out, written)
    return 0


def _diff(args) -> int:
    from reshard.diff import diff
    report = diff(reshard.open_checkpoint(args.a, args.tag_a, args.layout_rules),
                  reshard.open_checkpoint(args.b, args.tag_b, args.layout_rules),
                  atol=args.atol)
    if args.json:
        json.dump(report.to_dict(), sys.stdout, indent=2)
        print()
    else:
        for note in report.notes:
            print(f"note: {note}")
        for d in report.differences:
            print(d.line())
        print(report.summary())
    return 0 if report.equal else 1


def _group():
    """Under torchrun, the ranks share the files of one plan; otherwise this process writes them all."""
    from reshard.distributed import Solo, TorchGroup, launched_by_torchrun
    return TorchGroup() if launched_by_torchrun() else Solo()


def _print_plan(catalog, plan, fmt, dst, memory_budget, workers, as_json):
    import os
    import shutil
    from reshard.convert import batch_size_advice
    from reshard.executor import BUFFERS_PER_WORKER, chunk_bytes

    summary = plan.summary()
    buffers = BUFFERS_PER_WORKER * chunk_bytes(memory_budget, workers) * workers
    summary["estimated_peak_buffer_bytes"] = buffers
    where = os.path.abspath(dst) if dst else os.getcwd()
    while not os.path.exists(where):
        where = os.path.dirname(where)
    free = shutil.disk_usage(where).free
    summary["free_disk_bytes"] = free
    summary["free_disk_at"] = where
    summary["disk_ok"] = free > plan.bytes_written
    summary["advice"] = batch_size_advice(catalog, plan.target, fmt)
    if as_json:
        json.dump(summary, sys.stdout, indent=2)
        print()
        return summary
    print(f"source   {plan.source}")
    print(f"         {summary['source_topology']}")
    print(f"target   {plan.output.words()}")
    print(f"files    {len(summary['files'])} to write:")
    for f in summary["files"]:
        copied = " (copied)" if "copied_from" in f else ""
        print(f"           {f['path']:<56} {human_bytes(f['bytes']):>10}{copied}")
    print(f"read     {human_bytes(summary['bytes_read'])}")
    print(f"write    {human_bytes(summary['bytes_written'])}")
    print(f"memory   copy buffers at most {human_bytes(buffers)} (--memory-budget {human_bytes(memory_budget)}, "
          f"{workers} worker(s))")
    verdict = "enough" if summary["disk_ok"] else "NOT ENOUGH"
    print(f"disk     {human_bytes(free)} free at {where}: {verdict}")
    if summary["advice"]:
        print(f"advice   {summary['advice']}")
    return summary


if __name__ == "__main__":
    sys.exit(main())
