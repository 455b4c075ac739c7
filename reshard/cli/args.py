"""The command line's arguments: the parser of every command, its help, and the types of its values. Parsing
only: each command's work is in its module (reshard.cli.<command>), over the public API."""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import textwrap
from collections.abc import Callable
from typing import NoReturn, TypeVar

import reshard
from reshard import digests
from reshard.errors import ReshardError, UsageError
from reshard.formats import FRESH, NEW_RANK_POLICIES, WRITERS, every_spec_key, formats_taking, registry
from reshard.lifecycle import watching
from reshard.lifecycle.retention import FULL, TIERS, parse_duration
from reshard.rules import files as rule_files
from reshard.storage.names import WATCH_STATE

T = TypeVar("T")
# What add_subparsers returns: argparse names its class only privately, so the annotation is the one place it is said.
Subcommands = argparse._SubParsersAction


class _Parser(argparse.ArgumentParser):
    """A bad argument is one line, as every other usage error (exit 2), pointing at --help instead of printing the
    usage block; the subcommands' parsers are of this class too (add_subparsers makes its parsers so)."""

    def error(self, message: str) -> NoReturn:
        if os.environ.get("RANK", "0") == "0":
            command = self.prog.removeprefix("reshard").strip()
            print(f"reshard: {command + ': ' if command else ''}{message} "
                  f"(`{self.prog} --help` says what is accepted)", file=sys.stderr)
        self.exit(2)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Text wrapped at spaces only, never inside a `key=value` or a path; indented lines (the examples) as
    written; the rows of a table (a first word, two spaces, its meaning) wrapped under their meaning."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        lines = []
        for line in text.splitlines():
            row = re.match(r"\s+\S+\s\s+|\s*", line)
            indent = row.end() if row else 0      # (the pattern matches the empty string: always a match)
            lines += textwrap.wrap(line, width, subsequent_indent=" " * indent, break_long_words=False,
                                   break_on_hyphens=False) or [""]
        return lines

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(indent + line if line.startswith(" ") else
                         textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent,
                                       break_long_words=False, break_on_hyphens=False)
                         for line in text.splitlines())


def _examples(*lines: str) -> dict:
    """Keyword arguments for a parser: the examples that end its help."""
    return {"formatter_class": _Formatter, "epilog": "examples:\n" + "\n".join(f"  {line}" for line in lines)}


def _command(sub: Subcommands, name: str, what: str, examples: tuple, more: str = "") -> argparse.ArgumentParser:
    """A command's parser: `what` in the list of commands, and (with `more`) atop its help; then its examples."""
    return sub.add_parser(name, help=what, description=f"{what[0].upper()}{what[1:]}.{more}", **_examples(*examples))


KEY_COLUMN = 19     # a wider key (partition's) has its meaning on the next line


def _spec_help() -> str:
    """The keys of --to, each with what it takes and, where not every output format has a place for it, which
    --format does: from the table the parser uses (formats.every_spec_key: the writers' declarations)."""
    rows = []
    for k in every_spec_key():
        key = f"{k.name}={k.value}"
        taking = formats_taking([k.name])
        limits = [k.accepted()] if k.minimum is not None or k.choices else []     # (the others: their VALUE)
        limits += [] if len(taking) == len(WRITERS) else [f"{' and '.join(taking)} output"]
        meaning = f"{k.meaning} ({'; '.join(limits)})" if limits else k.meaning
        rows += [f"  {key}", f"  {'':<{KEY_COLUMN}}  {meaning}"] if len(key) > KEY_COLUMN else \
            [f"  {key:<{KEY_COLUMN}}  {meaning}"]
    return ("target topology: a layout descriptor file (a path, or one shipped with reshard by name: "
            f"{rule_files.names(rule_files.LAYOUT)}) or KEY=VALUE pairs joined by commas, each key once; keys left "
            "out keep the source's (default: the source's topology, e.g. to change only --format). "
            "Keys:\n" + "\n".join(rows))


# Progress bars show only where stderr is a terminal; --quiet takes them away there too.
QUIET_HELP = "no progress bar and no notes (errors and the requested output still print)"
SOURCE_HELP = f"a checkpoint: {registry.supported()}"
RULES_HELP = ("how tensor parallelism cut each tensor, for a TP checkpoint that does not say: a rule file's path, or "
              f"the name of one shipped with reshard ({rule_files.names(rule_files.TP_RULES)})")
TARGET_FORMAT_HELP = "target format (default: the source's own, where it is one of these): " + "; ".join(
    f"{f.name}: {f.writes}" for f in registry.FORMATS if f.writer is not None)
MEMORY_HELP = "bound on the copy buffers, e.g. 512MiB, 2GB (default 512MiB)"
WORKERS_HELP = "local processes writing files (default 1)"
DIGEST_HELP = (f"the manifest's digest of every file: {digests.BLAKE3} (the default: a third of sha256's CPU; b3sum "
               f"checks it), {digests.SHA256} (for sha256sum) or {digests.XXH3_128} (a sixth of BLAKE3's CPU, for "
               "storage faster than a core hashes; not cryptographic; xxh128sum); validate --checksums verifies each")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="reshard", description=(
        "Convert, export, inspect, validate and compare training checkpoints "
        f"({', '.join(f.title for f in registry.FORMATS)}) without executing code from them. "
        "`reshard COMMAND --help` describes each command, with examples."), **_examples(
        "reshard inspect ckpt/",
        "reshard convert ckpt/ new/ --to dp=4,zero=3",
        "reshard export ckpt/ model.safetensors"))
    parser.add_argument("--version", action="version", version=f"reshard {reshard.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _command(sub, "inspect", "what a checkpoint holds: topology, dtypes, optimizer, files",
                 ("reshard inspect ckpt/                  # the tag named in ckpt/latest",
                  "reshard inspect ckpt/ --tag global_step2 --params",
                  "reshard inspect ckpt/ --json"))
    _source_args(p)
    p.add_argument("--params", action="store_true", help="add a per-parameter table")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = _command(sub, "validate", "prove every element of every tensor is present exactly once "
                 "(exit 0 complete, 1 not, 2 usage)",
                 ("reshard validate ckpt/",
                  "reshard validate new/ --deep --checksums    # also NaN/Inf, CRC-32s, the manifest's digests",
                  "reshard validate ckpt/ --json"))
    _source_args(p)
    p.add_argument("--deep", action="store_true",
                   help="also read the bytes and report NaN/Inf and zip members whose CRC-32 does not match")
    p.add_argument("--checksums", action="store_true",
                   help="verify every file's digest (by its algorithm) against the reshard manifest (convert/export "
                   "write one; without one: a line says they are not verified, the verdict stands)")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = _command(sub, "plan", "what a conversion would read and write, without writing",
                 ("reshard plan ckpt/ --to dp=4,zero=3",
                  "reshard plan ckpt/ --to dp4-zero3 --dst new/",
                  "reshard plan ckpt/ --format dcp --json"))
    _source_args(p)
    p.add_argument("--to", default="", metavar="SPEC", help=_spec_help())
    p.add_argument("--tag-out", metavar="TAG", help="tag of the converted checkpoint (default: the source's)")
    p.add_argument("--format", dest="fmt", metavar=f"{{{','.join(WRITERS)}}}", help=TARGET_FORMAT_HELP)
    p.add_argument("--dst", help="where the output would go (for the free-disk check; s3:// needs no local disk)")
    p.add_argument("--memory-budget", default="512MiB", type=_size_arg, metavar="SIZE", help=MEMORY_HELP)
    p.add_argument("--workers", type=_positive_int, default=1, metavar="K", help=WORKERS_HELP)
    _new_rank_state_arg(p)
    _module_names_arg(p)
    p.add_argument("--json", action="store_true", help="print the plan summary as JSON")

    p = _command(sub, "convert", "write the checkpoint for another topology (DeepSpeed resumes from it)",
                 ("reshard convert ckpt/ new/ --to dp=4,zero=3     # tp and pp kept",
                  "reshard convert ckpt/ dcp/ --format dcp",
                  "reshard convert pipe/ pp2/ --to pp=2,dp=1,partition=type:Block,"
                  "layer_types=Embed/Block/LayerNorm/Block/Embed"),
                 " --format writes another format; training resumes from the output with the framework's own load "
                 "call.")
    p.add_argument("path", metavar="SRC", help=SOURCE_HELP)
    p.add_argument("dst", metavar="DST", help="the new save dir (created; holds 'latest' and the tag folder)")
    p.add_argument("--to", default="", metavar="SPEC", help=_spec_help())
    p.add_argument("--tag", help="the source tag (default: the one named in 'latest')")
    p.add_argument("--tag-out", metavar="TAG", help="tag of the converted checkpoint (default: the source's)")
    p.add_argument("--layout-rules", metavar="FILE", help=RULES_HELP)
    _config_arg(p)
    p.add_argument("--format", dest="fmt", metavar=f"{{{','.join(WRITERS)}}}", help=TARGET_FORMAT_HELP)
    _module_names_arg(p)
    _new_rank_state_arg(p)
    p.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    p.add_argument("--workers", type=_positive_int, default=1, metavar="K", help=WORKERS_HELP)
    p.add_argument("--memory-budget", default="512MiB", type=_size_arg, metavar="SIZE", help=MEMORY_HELP)
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty DST")
    p.add_argument("--resume", action="store_true",
                   help="after an interrupted run, keep the files it finished (checked by their digest)")
    p.add_argument("--digest", default=digests.DEFAULT, choices=digests.ALGORITHMS, help=DIGEST_HELP)
    p.add_argument("--quiet", action="store_true", help="no progress bar and no 'wrote' line (errors still print)")
    p.add_argument("--json", action="store_true", help="print what was written (files, bytes, topology, manifest) "
                   "as JSON")

    p = _command(sub, "export", "one consolidated state dict: safetensors (or HF shards), or torch",
                 ("reshard export ckpt/ model.safetensors",
                  "reshard export ckpt/ hf/ --max-shard-size 2GB --dtype bf16",
                  "reshard export ckpt/ model.pt --format torch"))
    p.add_argument("path", metavar="SRC", help=SOURCE_HELP)
    p.add_argument("out", metavar="OUT", help="a .safetensors (or .bin/.pt with --format torch) file, or a "
                   "directory for Hugging Face shards + index")
    p.add_argument("--tag", help="the source tag (default: the one named in 'latest')")
    p.add_argument("--layout-rules", metavar="FILE", help=RULES_HELP)
    p.add_argument("--dtype", default="auto", choices=["fp32", "bf16", "fp16", "auto"],
                   help="dtype of floating tensors (default auto: the training dtype, what save_pretrained writes: "
                        "a bf16 run exports bf16, an fp32 run fp32; fp32 for fp32 whatever the run); integer buffers "
                        "keep theirs")
    p.add_argument("--max-shard-size", type=_shard_size_arg, metavar="SIZE",
                   help="shard limit in huggingface_hub's units (5GB = 5e9 bytes; default 5GB in a directory)")
    p.add_argument("--with-optimizer", action="store_true",
                   help="also every optimizer state (one safetensors set per state) and optimizer.json")
    p.add_argument("--format", choices=["safetensors", "torch"],
                   help="safetensors (with --with-optimizer one set per state) or torch (one torch.save file); "
                        "default: torch for a .bin/.pt/.pth OUT, else safetensors")
    p.add_argument("--weights", default="master", choices=["master", "module"],
                   help="fp32 master copy (default) or the saved 16-bit module copy where there is one")
    p.add_argument("--names", metavar="FILE",
                   help="how the consumer names and cuts the weights: an export-names rule file, a path or the name "
                        f"of one shipped with reshard ({rule_files.names(rule_files.EXPORT_NAMES)}; mixtral-autoep-hf: "
                        "AutoEP's packed experts as Hugging Face's one tensor per expert)")
    p.add_argument("--config", metavar="FILE",
                   help="the model's config.json (Hugging Face's) for a checkpoint that holds none (torchtitan's: the "
                        "one in the run's hf_assets_path): written beside the weights, its values answering the "
                        "--names rules' counts by name (head_dim); and the reader's (a torchtitan save with fused "
                        "q/k/v: its key-value head count)")
    p.add_argument("--memory-budget", default="512MiB", type=_size_arg, metavar="SIZE", help=MEMORY_HELP)
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument("--resume", action="store_true",
                   help="after an interrupted run, keep the files it finished (checked by their digest)")
    p.add_argument("--digest", default=digests.DEFAULT, choices=digests.ALGORITHMS, help=DIGEST_HELP)
    p.add_argument("--quiet", action="store_true", help="no progress bar and no 'wrote' line (errors still print)")
    p.add_argument("--json", action="store_true", help="print what was written (files, bytes, manifest) as JSON")

    p = _command(sub, "diff", "compare two checkpoints of any formats and topologies, tensor by tensor "
                 "(exit 0 equal, 1 different, 2 trouble)",
                 ("reshard diff ckpt/ new/",
                  "reshard diff ckpt/ model.safetensors --atol 1e-6",
                  "reshard diff ckpt/ new/ --tag-a global_step2 --json"),
                 " Values compare as numbers: NaN equals NaN at the same element whatever its bits, inf equals inf; "
                 "a NaN or an infinity facing another value is counted apart from the largest finite difference, "
                 "which --atol bounds.")
    p.add_argument("a", metavar="A", help="a checkpoint (any format reshard reads)")
    p.add_argument("b", metavar="B", help="another checkpoint")
    p.add_argument("--tag-a", metavar="TAG", help="tag of A, for a DeepSpeed save dir")
    p.add_argument("--tag-b", metavar="TAG", help="tag of B, for a DeepSpeed save dir")
    p.add_argument("--layout-rules", metavar="FILE", help=RULES_HELP)
    _config_arg(p)
    p.add_argument("--atol", type=_tolerance, default=0.0, metavar="X",
                   help="largest absolute difference still equal (default 0)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _quiet_arg(p)
    p.set_defaults(error_exit=2)
    _lifecycle_commands(sub)
    return parser


def _lifecycle_commands(sub: Subcommands) -> None:
    """`list` and `prune`: the checkpoints of a run directory, and retention."""
    p = _command(sub, "list", "every checkpoint of a run directory: step, time, size by kind, format, topology, "
                 "complete or not, metrics",
                 ("reshard list out/", "reshard list out/ --json --price 0.023",
                  "reshard list out/ --metrics evals.csv"),
                 " Metadata only: each checkpoint is proven whole by the coverage proof of `reshard validate` "
                 "(no tensor byte read); a save still being written is shown in progress and not opened. Sizes are "
                 "the files' bytes (apparent size), a complete checkpoint's split into weights (one copy of the "
                 "model in the dtype it holds), optimizer state (moments, fp32 masters beside a 16-bit copy) and "
                 "other (RNG, scheduler, config, headers, padding). TIER: full, or weights for the weights-only "
                 "form `reshard thin` left.")
    p.add_argument("path", metavar="DIR", help="a run directory (DeepSpeed save dir, Hugging Face output dir, "
                   "Lightning checkpoint dir, DCP step dirs, or one holding several)")
    _run_dir_args(p)
    p.add_argument("--metric", metavar="NAME", help="the name of the values of a bare {step: value} metrics file")
    p.add_argument("--price", type=_non_negative_float, metavar="USD_PER_GB_MONTH",
                   help="storage price in USD per GB (10^9 bytes) and month: adds what each checkpoint, each kind "
                        "and the run cost a month")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = _command(sub, "prune", "delete the checkpoints a retention policy does not keep, thin to their weights those "
                 "it keeps at the weights tier only (a dry run without --yes)",
                 ("reshard prune out/ --keep-last 3                       # prints the plan",
                  "reshard prune out/ --keep-every 1000 --keep-steps 2 --delete-incomplete --yes",
                  "reshard prune out/ --keep-last 3 --keep-every 10:weights --keep-interval 1d:weights --price 0.023"),
                 " Each rule keeps at a tier, full (the default) or weights (`:weights`: the checkpoint is thinned to "
                 "its weights-only form, as by `reshard thin`); a checkpoint kept by several rules gets the richest "
                 "tier, one kept by none is deleted. Always kept full: the newest complete checkpoint and any one "
                 "`latest`, the framework's best (best_model_checkpoint, best_model_path) or a link names; an "
                 "incomplete checkpoint never counts toward --keep-last and is deleted only with "
                 "--delete-incomplete; a save in progress is never touched; one already weights-only stays so. "
                 "Deletion renames first, so a rerun finishes an interrupted prune; deletions come before thins, and "
                 "a checkpoint that cannot be thinned is left full.")
    p.add_argument("path", metavar="DIR", help="a run directory, as for `reshard list`")
    _policy_args(p)
    p.add_argument("--yes", action="store_true", help="delete and thin (default: print the plan only)")
    _run_dir_args(p)
    p.add_argument("--price", type=_non_negative_float, metavar="USD_PER_GB_MONTH",
                   help="storage price in USD per GB (10^9 bytes) and month: adds what each checkpoint and the run "
                        "cost a month before and after")
    p.add_argument("--json", action="store_true", help="print the plan (and what was deleted and thinned) as JSON")
    _quiet_arg(p)
    _thin_command(sub)
    _watch_command(sub)


def _thin_command(sub: Subcommands) -> None:
    p = _command(sub, "thin", "replace a full checkpoint by its framework's weights-only form, in place (a dry run "
                 "without --yes)",
                 ("reshard thin out/global_step2              # what would be dropped, bytes before -> after",
                  "reshard thin ckpt/global_step2 --yes        # (an HF Trainer run: out/checkpoint-200)",
                  "reshard thin out/global_step2 --yes --json"),
                 " The weights-only form is what the framework itself writes with its model-only option and loads "
                 "with its weights-only load: a DeepSpeed ZeRO-1/2 tag folder less its *_optim_states.pt, a ZeRO-3 "
                 "one with them written again without the moments (load_checkpoint(..., load_module_only=True, "
                 "load_optimizer_states=False)); an HF Trainer checkpoint-N/ less optimizer.pt or the DeepSpeed "
                 "engine's save (save_only_model=True; from_pretrained); a Trainer or Accelerate folder with FSDP "
                 "less optimizer_0/ or optimizer.bin, an Accelerate save_state without FSDP or DeepSpeed less "
                 "optimizer.bin (the Trainer's resume, load_state with the model alone prepared). Trainer state, "
                 "client state, config, tokenizer, scheduler and RNG files stay, with a "
                 "record of the thinning. Never thinned: the newest complete checkpoint of its series, one `latest`, "
                 "the framework's best or a link names, a save in progress, an incomplete or unverifiable "
                 "checkpoint. The thinned form is written beside the checkpoint, proven whole (every CRC-32 read), "
                 "then swapped in under a journal: a kill leaves one of the two whole, and the next thin, prune "
                 "--yes or watch finishes or rolls back the swap. In an S3 bucket the same, the thinned form put in "
                 "place by server-side copies, its record last."
                 f" The checkpoints that have a weights-only form: {registry.thinnable()}.")
    p.add_argument("path", metavar="CKPT", help="one checkpoint of a run directory, as `reshard list` shows it")
    p.add_argument("--yes", action="store_true", help="thin it (default: print what would be dropped and the "
                   "bytes before -> after)")
    p.add_argument("--keep-masters", action="store_true", help="keep the exact fp32 masters instead of the 16-bit "
                   "weights where the run has them (refused where the format's weights-only form cannot hold them)")
    p.add_argument("--recent", type=_non_negative_float, default=reshard.RECENT_SECONDS, metavar="S",
                   help=f"a file of the run modified less than S seconds ago marks its save in progress (default "
                        f"{reshard.RECENT_SECONDS:g})")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _watch_command(sub: Subcommands) -> None:
    p = _command(sub, "watch", "validate each checkpoint of a run as its save finishes, report it, apply a retention "
                 "policy (exit 0 when stopped by SIGINT/SIGTERM; with --once 0, or 1 if a checkpoint was broken)",
                 ("reshard watch out/ --once --keep-last 3     # one pass (cron); without --once, until SIGTERM",
                  "reshard watch out/ --once --keep-best 1 --metric eval_loss --metrics evals.csv "
                  "--export-best best.safetensors",
                  "reshard watch out/ --once --delete-incomplete --exec 'echo saved $RESHARD_STEP: {}'"),
                 " A checkpoint is taken once its save has finished (sizes equal at two looks --settle apart, no "
                 "file newer than --recent, DCP's .metadata written, `latest` moved past it) and validated as by "
                 "`reshard validate`; one line each (INCOMPLETE and why for a broken save). The policy (as for "
                 "`prune`, its rules at their tiers, always executed) deletes or thins only checkpoints the watcher "
                 "validated. State: DIR/"
                 f"{WATCH_STATE} (a restarted watcher does not report a checkpoint again).")
    p.add_argument("path", metavar="DIR", help="a run directory, as for `reshard list`")
    _policy_args(p)
    p.add_argument("--checksums", action="store_true", help="also verify every file's digest against the "
                   "checkpoint's reshard manifest, where it has one (training saves have none)")
    p.add_argument("--export-best", metavar="OUT", help="keep OUT (a .safetensors file outside DIR) the export of "
                   "the best validated checkpoint by --metric, replaced by a rename when the best changes")
    p.add_argument("--exec", dest="exec_cmd", metavar="CMD", help="a shell command run for each complete "
                   f"checkpoint, its path in ${watching.EXEC_VARIABLE} and in place of {{}} (its step in "
                   f"${watching.STEP_VARIABLE})")
    p.add_argument("--once", action="store_true", help="one pass, then exit (1 if a broken checkpoint was found or "
                   "the policy could not be evaluated or --exec/--export-best failed)")
    p.add_argument("--interval", type=_positive_float, default=watching.INTERVAL_SECONDS, metavar="S",
                   help=f"seconds between passes (default {watching.INTERVAL_SECONDS:g})")
    _run_dir_args(p, settle=watching.SETTLE_SECONDS)


def _policy_args(p: argparse.ArgumentParser) -> None:
    tier = "; K:weights keeps them as their weights only (thinned, as by `reshard thin`), K:full (the default) whole"
    p.add_argument("--keep-last", type=_tiered(_positive_int), metavar="K",
                   help=f"keep the K newest complete checkpoints{tier}")
    p.add_argument("--keep-best", type=_tiered(_positive_int), metavar="M",
                   help="keep the M best complete checkpoints by --metric (M:weights or M:full, as for --keep-last)")
    p.add_argument("--metric", metavar="NAME",
                   help="the metric --keep-best ranks by (eval_loss; HF's eval_ prefix may be left out)")
    p.add_argument("--mode", choices=["min", "max"], default="min", help="min: lower is better (default), max: higher")
    p.add_argument("--keep-every", type=_tiered(_positive_int), metavar="N",
                   help="keep checkpoints whose step is a multiple of N (N:weights or N:full)")
    p.add_argument("--keep-steps", type=_tiered(_steps_arg), metavar="S,S,...",
                   help="keep these steps (S,S:weights or S,S:full)")
    p.add_argument("--keep-interval", type=_tiered(_duration_arg), metavar="DURATION",
                   help="keep one checkpoint per DURATION of save time (30m, 6h, 2d, 1w): oldest first by the time "
                        "of its newest file, one whenever DURATION has passed since the last this rule kept "
                        "(DURATION:weights or DURATION:full)")
    p.add_argument("--delete-incomplete", action="store_true", help="also delete incomplete checkpoints nothing names")


def policy(args: argparse.Namespace) -> reshard.Policy:
    """The retention policy of prune's and watch's options, each rule at its tier."""
    last, best, every, steps, interval = (getattr(args, name) or (None, FULL) for name in
                                          ("keep_last", "keep_best", "keep_every", "keep_steps", "keep_interval"))
    return reshard.Policy(keep_last=last[0], keep_best=best[0], metric=args.metric, mode=args.mode,
                          keep_every=every[0], keep_steps=steps[0] or (), keep_interval=interval[0],
                          delete_incomplete=args.delete_incomplete, keep_last_tier=last[1], keep_best_tier=best[1],
                          keep_every_tier=every[1], keep_steps_tier=steps[1], keep_interval_tier=interval[1])


def _tiered(parse: Callable[[str], T]) -> Callable[[str], tuple[T, str]]:
    """An argparse type for `VALUE[:TIER]`: (parse(VALUE), TIER), the tier full where none is named."""
    def tiered(text: str) -> tuple[T, str]:
        value, tier = text.rsplit(":", 1) if ":" in text else (text, FULL)
        if tier not in TIERS:
            raise argparse.ArgumentTypeError(f"not a tier: {tier!r} in {text!r} ({' or '.join(TIERS)}, e.g. "
                                             "3:weights)")
        return parse(value), tier
    return tiered


def _duration_arg(text: str) -> float:
    try:
        return parse_duration(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _run_dir_args(p: argparse.ArgumentParser, settle: float = 0.0) -> None:
    p.add_argument("--metrics", metavar="FILE", help="metrics per step: JSON {step: value}, {name: {step: value}}, "
                   "[{step, name: value}] or CSV with a step column")
    p.add_argument("--recent", type=_non_negative_float, default=reshard.RECENT_SECONDS, metavar="S",
                   help=f"a file modified less than S seconds ago marks its save in progress (default "
                        f"{reshard.RECENT_SECONDS:g})")
    p.add_argument("--settle", type=_non_negative_float, default=settle, metavar="S",
                   help=f"also look again after S seconds: a checkpoint whose files changed is in progress (default "
                        f"{settle:g})")


def _steps_arg(text: str) -> tuple:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of steps: {text!r} (e.g. 1000,5000)") from None



_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def _size_arg(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    size = int(float(m.group(1)) * _UNITS[m.group(2).lower()]) if m and m.group(2).lower() in _UNITS else 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GB)")
    return size


def _shard_size_arg(text: str) -> str:
    """A shard limit in huggingface_hub's units, checked here (as the export will read it), kept as given."""
    from reshard.formats.hf import sharding as hf
    try:
        size = hf.parse_size(text)
    except ReshardError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"not a shard size: {text!r} (e.g. 2GB, 500MB: decimal units, 5GB = 5e9 "
                                         "bytes)")
    return text


def _seconds(text: str, least: float, strict: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > least if strict else value >= least)):
        raise argparse.ArgumentTypeError(f"not a {'positive' if strict else 'non-negative'} number of seconds: "
                                         f"{text!r}")
    return value


def _positive_float(text: str) -> float:
    return _seconds(text, 0.0, strict=True)


def _non_negative_float(text: str) -> float:
    return _seconds(text, 0.0, strict=False)


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"not a tolerance: {text!r} (a finite number, 0 or more)")
    return value


def _positive_int(text: str) -> int:
    value = int(text) if re.fullmatch(r"\s*[0-9]+\s*", text) else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive whole number: {text!r}")
    return value


def _source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help=SOURCE_HELP)
    p.add_argument("--tag", help="the tag folder to read (default: the one named in 'latest')")
    p.add_argument("--layout-rules", metavar="FILE", help=RULES_HELP)
    _config_arg(p)
    _quiet_arg(p)


CONFIG_HELP = ("the model's config.json (Hugging Face's) where the checkpoint does not record what it gives: a "
               "torchtitan save with fused q/k/v (every llama3 flavor's default) needs its key-value head count")


def _config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help=CONFIG_HELP)


def _module_names_arg(p: argparse.ArgumentParser) -> None:
    """plan's and convert's --names (a module-names rule file, or an export-names one read backwards)."""
    p.add_argument("--names", metavar="FILE",
                   help="the names and shapes of the model that loads the output: a module-names rule file, a path "
                        f"or the name of one shipped with reshard ({rule_files.names(rule_files.MODULE_NAMES)}; "
                        "mixtral-autoep-fsdp: an AutoEP Mixtral as transformers' MixtralForCausalLM, for --format "
                        "dcp); or an export-names file read backwards, for a model published under its consumer's "
                        "names (megatron-core-llama: a Hugging Face Llama folder, --format megatron, its args from "
                        "config.json; torchtitan-llama: the same folder, --format torchtitan, the weights-only step "
                        "folder torchtitan's checkpoint.initial_load_path loads)")


def _new_rank_state_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--new-rank-state", choices=NEW_RANK_POLICIES, default=FRESH,
                   help="a training framework's per-process files (HF Trainer's rng_state_K.pth; verl's "
                        "extra_state_world_size_W_rank_K.pt) for processes the source did not have: fresh "
                        "(default: none, the framework seeds them; verl's the lr scheduler alone), copy-rank0 "
                        "(process 0's, whose random stream they repeat), fail (refuse)")


def _quiet_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help=QUIET_HELP)


