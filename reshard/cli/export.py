"""`reshard export`: one consolidated state dict, safetensors (or Hugging Face shards) or torch."""
from __future__ import annotations

import argparse

import reshard
from reshard.cli.output import print_written


def run(args: argparse.Namespace) -> int:
    written = reshard.export(args.path, args.out, tag=args.tag, layout_rules=args.layout_rules,
                             dtype=args.dtype, max_shard_size=args.max_shard_size, with_optimizer=args.with_optimizer,
                             fmt=args.format, weights=args.weights, names=args.names, config=args.config,
                             memory_budget=args.memory_budget, overwrite=args.overwrite, resume=args.resume,
                             progress=not args.quiet, digest=args.digest)
    print_written(args, args.out, written)
    return 0
