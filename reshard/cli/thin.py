"""`reshard thin`: a full checkpoint replaced by its framework's weights-only form, in place, with --yes."""
from __future__ import annotations

import argparse

import reshard
from reshard.cli.output import dump
from reshard.commands.inspect import human_bytes


def run(args: argparse.Namespace) -> int:
    result = reshard.thin(args.path, yes=args.yes, keep_masters=args.keep_masters, recent=args.recent)
    if args.json:
        dump(result.to_dict())
        return 0
    for path in result.recovered:
        print(f"finished an interrupted thin of {path}")
    sizes = f"{human_bytes(result.bytes_before)} -> {human_bytes(result.bytes_after)} (the files' bytes)"
    if result.executed:
        print(f"thinned {result.path}: dropped {result.what}; {sizes}; loads with {result.load}")
    else:
        for name in result.dropped:
            print(f"{'write again' if name in result.written else 'drop'}  {name}")
        for name in result.written:
            if name not in result.dropped:
                print(f"write  {name}")
        print(f"dry run: {result.path} would drop {result.what}; {sizes}; --yes thins it")
    return 0
