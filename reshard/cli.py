"""Command line: argument parsing and printing only; the work is in the library."""
from __future__ import annotations

import argparse
import json
import sys

import reshard
from reshard.errors import ReshardError
from reshard.inspect import human_bytes, jsonable


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ReshardError as e:
        print(f"reshard: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("reshard: interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reshard", description=(
        "Inspect and validate distributed training checkpoints (DeepSpeed ZeRO-1/2/3) "
        "without executing code from them."))
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
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_validate)
    return parser


def _source_args(p):
    p.add_argument("path", metavar="PATH", help="a DeepSpeed save dir (with 'latest') or a tag folder")
    p.add_argument("--tag", help="the tag folder to read (default: the one named in 'latest')")


def _inspect(args) -> int:
    info = reshard.inspect(reshard.open_checkpoint(args.path, args.tag), params=args.params)
    if args.json:
        json.dump(jsonable(info), sys.stdout, indent=2)
        print()
        return 0
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
        print(f"    {row['name']:<32} {shape:<12} {row['kind']:<9} {row['dtype'] or '':<9} {group:<8} "
              f"{','.join(row['states'])} {tied}")
    return 0


def _validate(args) -> int:
    report = reshard.validate(reshard.open_checkpoint(args.path, args.tag), deep=args.deep)
    if args.json:
        json.dump(report.to_dict(), sys.stdout, indent=2)
        print()
    else:
        for problem in report.problems:
            print(problem)
        print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
