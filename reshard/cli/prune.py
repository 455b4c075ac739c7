"""`reshard prune`: the checkpoints a retention policy does not keep, deleted, and those it keeps at the weights tier
only, thinned, with --yes."""
from __future__ import annotations

import argparse
import sys

import reshard
from reshard.cli.args import policy
from reshard.cli.list import usd
from reshard.cli.output import dump
from reshard.commands.inspect import human_bytes
from reshard.lifecycle.pruning import PrunePlan
from reshard.lifecycle.retention import DELETE, Decision
from reshard.text import counted


def run(args: argparse.Namespace) -> int:
    plan = reshard.prune(args.path, policy(args), yes=args.yes, metrics=args.metrics, recent=args.recent,
                         settle=args.settle)
    if args.json:
        dump(plan.to_dict(args.price))
    else:
        print_prune(plan, args.quiet, args.price)
    return 1 if plan.not_thinned else 0


def print_prune(plan: PrunePlan, quiet: bool, price: float | None = None) -> None:
    """`reshard prune`: the plan (keep / thin / delete / untouched, the tier, bytes before → after, why), then what
    it frees or freed, and what the run costs a month before and after."""
    for d in plan.decisions:
        r = d.checkpoint
        step = "" if r.step is None else f"step {r.step}"
        tier = d.tier or ("-" if d.action == DELETE else "as is")
        print(f"{d.action:<9} {r.name}  {step}  {tier}  {sizes(plan, d)}: {'; '.join(d.reasons)}")
    if plan.executed:
        for path in plan.changed:
            print(f"reshard: {path}: its files changed since it was listed: left alone", file=sys.stderr)
        for refused in plan.not_thinned:
            print(f"reshard: {refused.why} (left full)", file=sys.stderr)
        if plan.trash and not quiet:
            print(f"finished an interrupted prune: removed {counted(len(plan.trash), 'renamed checkpoint')}")
        print(f"deleted {counted(len(plan.removed), 'checkpoint')}, thinned {len(plan.thinned)} to their weights, "
              f"freed {human_bytes(plan.bytes_freed)}: {totals(plan)}")
    else:
        thins = len(plan.thinning())
        estimate = " (thins estimated: their weights and other bytes)" if thins else ""
        print(f"dry run: would delete {counted(len(plan.deleting()), 'checkpoint')}, thin {thins} to their weights, "
              f"freeing {human_bytes(plan.bytes_freed)} (the files' bytes){estimate}: {totals(plan)}"
              + ("" if quiet else "; --yes does it"))
    if price is not None:
        cost = plan.to_dict(price)["cost_per_month"]
        print(f"cost: {usd(cost['before'])} a month before, {usd(cost['after'])} after (at ${price:g} per GB "
              "(10^9 bytes) and month)")


def sizes(plan: PrunePlan, d: Decision) -> str:
    """`2.5 TiB → 325.9 GiB (estimate)`: a checkpoint's files' bytes before and after the plan."""
    after = human_bytes(plan.after(d))
    return f"{human_bytes(d.checkpoint.bytes)} → {'~' if plan.estimated(d) else ''}{after}" + \
        (" (estimate)" if plan.estimated(d) else "")


def totals(plan: PrunePlan) -> str:
    return f"{human_bytes(plan.bytes_before)} → {human_bytes(plan.bytes_after)} in all"
