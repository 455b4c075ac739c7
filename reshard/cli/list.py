"""`reshard list`: every checkpoint of a run directory, complete or not; exit 1 when one shown is incomplete."""
from __future__ import annotations

import argparse

import reshard
from reshard.cli.output import dump
from reshard.commands.inspect import human_bytes
from reshard.lifecycle.listing import COMPLETE, INCOMPLETE, Checkpoint, RunListing
from reshard.lifecycle.sizes import GB, RunBytes, cost_per_month
from reshard.text import counted


def run(args: argparse.Namespace) -> int:
    listing = reshard.list_checkpoints(args.path, metrics=args.metrics, metric_name=args.metric, recent=args.recent,
                                       settle=args.settle)
    if args.json:
        dump(listing.to_dict(args.price))
    else:
        print_listing(listing, args.price)
    # a cron job's test: a broken checkpoint shown is a failure, without parsing --json
    return 1 if any(r.status == INCOMPLETE for r in listing.checkpoints) else 0


def _when(mtime: float) -> str:
    import time
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime)) if mtime else "-"


def _metrics_words(metrics: dict) -> str:
    return " ".join(f"{k}={v:g}" for k, v in sorted(metrics.items()))


def _kinds(r: Checkpoint) -> str:
    """WEIGHTS, OPTIMIZER, OTHER columns: `?` where no reader read the checkpoint whole."""
    kinds = r.bytes_by_kind
    values = ["?"] * 3 if kinds is None else [human_bytes(n) for n in (kinds.weights, kinds.optimizer, kinds.other)]
    return "  ".join(f"{v:>10}" for v in values)


def _tier(r: Checkpoint) -> str:
    """TIER: `full`, or `weights` (weights-only: thinned by `reshard thin`); `-` where the checkpoint is not proven
    complete (what it holds is not known)."""
    if r.status != COMPLETE:
        return "-"
    return "weights" if r.weights_only else "full"


def usd(amount: float) -> str:
    """Dollars and cents (what `--json`'s `cost_per_month` holds exactly)."""
    return f"${amount:,.2f}" if amount >= 0.005 or amount == 0 else "<$0.01"


def print_listing(listing: RunListing, price: float | None = None) -> None:
    """`reshard list`: one row per checkpoint, oldest first, then the run's total (and cost, with a price)."""
    rows = listing.checkpoints
    print(f"{listing.root}: {len(rows)} checkpoint{'s' * (len(rows) != 1)} (complete: the {listing.check} proof "
          "on each one's metadata; `reshard validate --deep --checksums` reads the bytes; sizes: the files' bytes)")
    width = max([len(r.name) for r in rows] + [4])
    cost = f"{'COST/MONTH':>11}  " if price is not None else ""
    print(f"  {'STEP':>8}  {'SAVED':<19}  {'SIZE':>10}  {'WEIGHTS':>10}  {'OPTIMIZER':>10}  {'OTHER':>10}  {cost}"
          f"{'FORMAT':<12} {'TOPOLOGY':<16} {'STATUS':<12} {'TIER':<7} NAME")
    for r in rows:
        step = "-" if r.step is None else str(r.step)
        status = "INCOMPLETE" if r.status == "incomplete" else r.status
        extra = [f"<- {', '.join(r.pinned)}"] if r.pinned else []
        if r.metrics:
            extra.append(_metrics_words(r.metrics))
        cost = f"{usd(r.bytes / GB * price):>11}  " if price is not None else ""
        print(f"  {step:>8}  {_when(r.mtime):<19}  {human_bytes(r.bytes):>10}  {_kinds(r)}  {cost}"
              f"{r.format or '?':<12} {r.topology or '-':<16} {status:<12} {_tier(r):<7} {r.name:<{width}} "
              f"{'  '.join(extra)}".rstrip())
        if r.why:
            print(f"  {'':>8}  {r.why}")
    print_total(listing.total_bytes_by_kind(), len(rows), price)
    for note in listing.notes:
        print(f"note: {note}")
    if listing.trash:
        print(f"note: {counted(len(listing.trash), 'checkpoint')} an interrupted prune renamed still on disk; "
              "`reshard prune DIR --yes` removes them")


def print_total(total: RunBytes, count: int, price: float | None) -> None:
    """The run's line: its files' bytes by kind (reshard.lifecycle.sizes.RunBytes), and what they cost a month at
    `price`."""
    parts = [f"{kind} {human_bytes(n)}" for kind, n in (("weights", total.weights), ("optimizer", total.optimizer),
                                                         ("other", total.other))]
    if total.unknown:
        parts.append(f"unknown {human_bytes(total.unknown)} (not read whole)")
    print(f"total: {human_bytes(total.total)} in {counted(count, 'checkpoint')}: {', '.join(parts)}")
    if price is not None:
        costs = cost_per_month(total.to_dict(), price)
        words = [f"{kind} {usd(costs[kind])}" for kind in ("weights", "optimizer", "other")]
        if total.unknown:
            words.append(f"unknown {usd(costs['unknown'])}")
        print(f"cost: {usd(costs['total'])} a month at ${price:g} per GB (10^9 bytes) a month: {', '.join(words)}")
