"""`reshard prune`: the checkpoints a retention policy does not keep, deleted with --yes."""
from __future__ import annotations

import sys

import reshard
from reshard.cli.args import policy
from reshard.cli.output import dump
from reshard.inspection import human_bytes
from reshard.text import counted


def run(args) -> int:
    plan = reshard.prune(args.path, policy(args), yes=args.yes, metrics=args.metrics, recent=args.recent,
                         settle=args.settle)
    if args.json:
        dump(plan.to_dict())
    else:
        print_prune(plan, args.quiet)
    return 0


def print_prune(plan, quiet: bool) -> None:
    """`reshard prune`: the plan (keep / delete / untouched, why), then what it frees or freed."""
    for d in plan.decisions:
        r = d.checkpoint
        step = "" if r.step is None else f"step {r.step}"
        print(f"{d.action:<9} {r.name}  {step}  {human_bytes(r.bytes)}: {'; '.join(d.reasons)}")
    count = len(plan.deleting())
    if plan.executed:
        for path in plan.changed:
            print(f"reshard: {path}: its files changed since it was listed: left alone", file=sys.stderr)
        if plan.trash and not quiet:
            print(f"finished an interrupted prune: removed {counted(len(plan.trash), 'renamed checkpoint')}")
        print(f"deleted {counted(len(plan.removed), 'checkpoint')}, freed {human_bytes(plan.bytes_freed)}")
    else:
        print(f"dry run: would delete {counted(count, 'checkpoint')}, freeing {human_bytes(plan.bytes_freed)} "
              "(the files' bytes)" + ("" if quiet else "; --yes deletes them"))
