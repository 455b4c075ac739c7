"""The public Python API: one function per command of the CLI, each returning a typed result (the CLI prints them).

A `source` is a checkpoint's path (any format reshard reads), or a Catalog already opened (`open_checkpoint`);
plan, convert and export also take a Complete, the proof `prove_complete` made, and then do not prove it again.
The modules named as these functions are imported here, at the top: `reshard.convert`, `reshard.export` and
`reshard.validate` are these functions, not the modules of those names (a module imported for the first time
later would take its name back on the package).
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

from reshard.commands.convert import framework_files, make_plan, names_every_param
from reshard.commands.export import export_plan
from reshard.commands.inspect import Inspection, inspect as inspect_catalog
from reshard.commands.validate import (
    Complete,
    ValidationReport,
    prove_complete as prove_catalog_complete,
    validate as validate_catalog,
)
from reshard.core.catalog import Catalog
from reshard.digests import DEFAULT as DEFAULT_DIGEST
from reshard.errors import ReshardError, UnknownFormatError
from reshard.formats import FRESH, read, takes
from reshard.lifecycle.run_layout import scan
from reshard.storage import files as fs

# The modules that write and compare bytes load when a call needs them: `import reshard`, and opening a checkpoint,
# stay light (no multiprocessing, no comparison).
if TYPE_CHECKING:
    from reshard.commands.diff import DiffReport
    from reshard.commands.plan import PlanSummary
    from reshard.execution.executor import Written


def open_checkpoint(path: str | os.PathLike[str], tag: str | None = None,
                    layout_rules: str | None = None, config: str | None = None, *,
                    model_order: bool = True) -> Catalog:
    """Read a checkpoint's metadata into a Catalog; nothing in it is executed, no tensor byte is read.

    Args:
        path: a checkpoint: DeepSpeed save dir or tag folder, universal or DCP directory, .pt/.pth/.bin, .ckpt,
            Hugging Face folder, safetensors file or folder.
        tag: the tag folder to read (default: the one named in `latest`).
        layout_rules: how tensor parallelism cut the tensors, for a checkpoint that does not say: a rule file's
            path, or the name of one shipped with reshard ("megatron-gpt", "llama-autotp").
        config: the model's config.json, for a checkpoint that does not record what it gives (a torchtitan save with
            fused q/k/v: the key-value head count that places the optimizer's state on wq, wk and wv).
        model_order: False where the caller names every param itself (a convert with an export-names rule file,
            an import): a Hugging Face folder's safetensors are then not put in the model's order nor their ties
            learnt, which builds the model class of config.json with the installed transformers (seconds).

    Returns:
        The Catalog (reshard.core.catalog): every logical tensor, where its bytes lie, the non-tensor state.
        What is wrong but readable is in `catalog.problems`; what cannot be read raises a ReshardError.

    Example:
        >>> catalog = reshard.open_checkpoint("ckpt/")
        >>> catalog.format, catalog.layout.dp
        ('deepspeed', 2)
    """
    try:
        return read(os.fspath(path), tag, layout_rules, config, model_order)
    except UnknownFormatError as e:
        raise _run_directory_hint(os.fspath(path)) or e from None


def inspect(source: str | os.PathLike[str] | Catalog, params: bool = False, *, tag: str | None = None,
            layout_rules: str | None = None, config: str | None = None) -> Inspection:
    """What a checkpoint holds, as `reshard inspect` shows it.

    Args:
        source: a checkpoint's path, or its Catalog.
        params: also a table of the parameters (`parameter_table`).
        tag, layout_rules, config: as for open_checkpoint, when `source` is a path.

    Returns:
        An Inspection: topology, dtypes, optimizer, step, parameters, files; `to_dict()` is what
        `reshard inspect --json` prints.

    Example:
        >>> info = reshard.inspect("ckpt/")
        >>> info.topology, info.zero_stage, info.optimizer
        (Mesh(dp=2, tp=1, pp=1, world_size=2), 2, 'AdamW')
    """
    return inspect_catalog(_catalog(source, tag, layout_rules, config), params=params)


def validate(source: str | os.PathLike[str] | Catalog, deep: bool = False, checksums: bool = False,
             progress: bool = False, *, tag: str | None = None, layout_rules: str | None = None,
             config: str | None = None) -> ValidationReport:
    """Prove every element of every tensor present exactly once, as `reshard validate` does.

    Args:
        source: a checkpoint's path, or its Catalog.
        deep: also read every byte: NaN/Inf, and zip members whose CRC-32 does not match.
        checksums: verify every file's digest (by its algorithm) against the reshard manifest (convert and export
            write one).
        progress: bars of the bytes read on stderr, where it is a terminal.
        tag, layout_rules, config: as for open_checkpoint, when `source` is a path.

    Returns:
        A ValidationReport: `ok`, `problems` (each a Problem: file, tensor, kind, message) and what was counted;
        `to_dict()` is what `reshard validate --json` prints.

    Example:
        >>> report = reshard.validate("ckpt/")
        >>> report.ok, report.problems, report.missing_elements
        (True, (), 0)
    """
    return validate_catalog(_catalog(source, tag, layout_rules, config), deep=deep, checksums=checksums,
                            progress=progress)


def prove_complete(source: str | os.PathLike[str] | Catalog, *, tag: str | None = None,
                   layout_rules: str | None = None, config: str | None = None) -> Complete:
    """The proof that a checkpoint is whole, which plan, convert and export take.

    Args:
        source: a checkpoint's path, or its Catalog.
        tag, layout_rules, config: as for open_checkpoint, when `source` is a path.

    Returns:
        A Complete: the catalog and the report that proved it. A checkpoint with problems raises a ReshardError
        (one line: how many problems, the first one).

    Example:
        >>> complete = reshard.prove_complete("ckpt/")
        >>> complete.report.ok
        True
    """
    return prove_catalog_complete(_catalog(source, tag, layout_rules, config))


def plan(source: str | os.PathLike[str] | Catalog | Complete, to: str = "", *, tag: str | None = None,
         layout_rules: str | None = None, config: str | None = None, tag_out: str | None = None,
         fmt: str | None = None, new_rank_state: str = FRESH, dst: str | os.PathLike[str] | None = None,
         memory_budget: int | None = None, workers: int = 1, names: str | None = None) -> PlanSummary:
    """What a conversion would read and write, without writing, as `reshard plan` shows it.

    Args:
        source: a checkpoint's path, its Catalog, or the Complete proof of it.
        to: the target topology: KEY=VALUE pairs ("dp=4,zero=3"; keys left out keep the source's) or a layout
            descriptor file (a path, or the name of one shipped with reshard: "dp4-zero3").
        tag, layout_rules, config: as for open_checkpoint, when `source` is a path.
        tag_out: the output's tag (default: the source's).
        fmt: the output's format (deepspeed, dcp, universal; default: the source's).
        new_rank_state: a training framework's per-process files for processes the source lacked, verl's extra
            state too: "fresh", "copy-rank0" or "fail".
        dst: where the output would go, for the free-disk check (default: the working directory).
        memory_budget: bound on the copy buffers, in bytes (default: 512 MiB, reshard.execution.executor's);
            workers: local processes writing files.
        names: a module-names rule file (a path, or a name shipped with reshard: "mixtral-autoep-fsdp") putting the
            params under the names and shapes of the model that loads the output (reshard.rules.module_names).

    Returns:
        A PlanSummary: the files, bytes read and written, buffers, free disk (`disk_ok`), advice; `plan` is the
        Plan itself; `to_dict()` is what `reshard plan --json` prints.

    Example:
        >>> summary = reshard.plan("ckpt/", "dp=4")
        >>> summary.target_topology, len(summary.files), summary.disk_ok
        ('dp=4,tp=1,pp=1,zero=2', 8, True)
    """
    from reshard.commands.plan import summarize
    complete = _complete(source, tag, layout_rules, config, names)
    made = make_plan(complete, to, tag_out, fmt, new_rank_state, names)
    return summarize(complete.catalog, made, fmt=fmt, new_rank_state=new_rank_state,
                     dst=None if dst is None else os.fspath(dst), memory_budget=memory_budget, workers=workers)


def convert(source: str | os.PathLike[str] | Catalog | Complete, dst: str | os.PathLike[str], to: str = "", *,
            tag: str | None = None, layout_rules: str | None = None, config: str | None = None,
            tag_out: str | None = None, fmt: str | None = None, new_rank_state: str = FRESH, workers: int = 1,
            memory_budget: int | None = None, overwrite: bool = False, resume: bool = False,
            progress: bool = False, names: str | None = None, digest: str = DEFAULT_DIGEST) -> Written | None:
    """Write the checkpoint for another topology (or format), as `reshard convert` does; the framework resumes
    from the output with its own load call. Under torchrun the ranks share the files.

    Args:
        source, to, tag, layout_rules, config, tag_out, fmt, new_rank_state, workers, memory_budget, names: as for
            plan.
        dst: the new save dir (created; it must be empty, or `overwrite`).
        overwrite: replace a non-empty `dst`.
        resume: after an interrupted run, keep the files it finished (checked by their digest).
        progress: a bar of the bytes written on stderr, where it is a terminal.
        digest: the manifest's digest of every file: "blake3" (the default: a third of sha256's CPU), "sha256"
            (for `sha256sum`) or "xxh3-128" (a sixth of BLAKE3's CPU; not cryptographic); `validate(checksums=True)`
            verifies each.

    Returns:
        Written: every file on disk with its size, the manifest, the stage cut of a pipeline target and what
        became of the training framework's files; `to_dict()` is what `reshard convert --json` prints. None on
        torchrun ranks other than 0 (rank 0 commits).

    Example:
        >>> written = reshard.convert("ckpt/", "new/", "dp=4")
        >>> written.output.topology, reshard.validate("new/").ok
        ('dp=4,tp=1,pp=1,zero=2', True)
    """
    complete = _complete(source, tag, layout_rules, config, names)
    made = make_plan(complete, to, tag_out, fmt, new_rank_state, names)
    written = _execute(made, dst, overwrite=overwrite, memory_budget=memory_budget, workers=workers,
                       progress=progress, resume=resume, digest=digest)
    if written is None:
        return None
    return replace(written, stage_cut=made.stage_cut,
                   framework_files=tuple(framework_files(complete.catalog, made.target, fmt, new_rank_state)))


def export(source: str | os.PathLike[str] | Catalog | Complete, out: str | os.PathLike[str], *,
           tag: str | None = None, layout_rules: str | None = None, dtype: str = "auto",
           max_shard_size: str | None = None, with_optimizer: bool = False, fmt: str | None = None,
           weights: str = "master", names: str | None = None, config: str | None = None,
           memory_budget: int | None = None, overwrite: bool = False, resume: bool = False, progress: bool = False,
           digest: str = DEFAULT_DIGEST) -> Written | None:
    """One consolidated state dict, as `reshard export` writes it: safetensors (or Hugging Face shards with an
    index), or one torch.save file.

    Args:
        source, tag, layout_rules: as for plan.
        out: a .safetensors (or .bin/.pt with fmt="torch") file, or a directory for shards and their index.
        dtype: of floating tensors: "auto" (the default: the training precision, what the model holds and
            `save_pretrained` writes — a bf16 run's weights in bf16, an fp32 run's in fp32), "fp32", "bf16", "fp16".
        max_shard_size: a shard limit in huggingface_hub's units ("5GB" = 5e9 bytes; default 5GB in a directory).
        with_optimizer: also every optimizer state (one safetensors set per state) and optimizer.json.
        fmt: "safetensors" or "torch" (default: torch for a .bin/.pt/.pth `out`, else safetensors).
        weights: "master" (the fp32 master copy) or "module" (the saved 16-bit copy, where there is one).
        names: an export-names rule file (a path, or a name shipped with reshard) renaming and cutting weights.
        config: the model's config.json for a checkpoint without one (torchtitan's): written beside the weights,
            its values answering the rules' counts by name; the reader's too where its format takes one.
        memory_budget, overwrite, resume, progress, digest: as for convert.

    Returns:
        Written (as for convert); `to_dict()` is what `reshard export --json` prints. None on torchrun ranks
        other than 0. A checkpoint of several models (a verl step: actor and critic) exports its first, the actor;
        `left_out` names the others' folders, each exported on its own.

    Example:
        >>> written = reshard.export("ckpt/", "model.safetensors")
        >>> written.output.format, [os.path.basename(f.path) for f in written.files]
        ('safetensors', ['model.safetensors'])
    """
    # the config is also the reader's where its format takes one (torchtitan's fused q/k/v)
    read_config = config if config and not isinstance(source, Catalog | Complete) and \
        takes(os.fspath(source), tag, "config") else None
    complete = _complete(source, tag, layout_rules, read_config)
    made = export_plan(complete, os.fspath(out), dtype=dtype, max_shard_size=max_shard_size,
                       with_optimizer=with_optimizer, fmt=fmt, weights=weights, names=names, config=config)
    written = _execute(made.plan, out, overwrite=overwrite, memory_budget=memory_budget, progress=progress,
                       single_file=made.single_file, resume=resume, digest=digest)
    # one model is exported: the checkpoint's first (a verl step's actor), the others named
    left_out = tuple(folder for folder, _ in complete.catalog.companion_folders())
    return replace(written, left_out=left_out) if written is not None and left_out else written


def diff(a: str | os.PathLike[str] | Catalog, b: str | os.PathLike[str] | Catalog, *, tag_a: str | None = None,
         tag_b: str | None = None, layout_rules: str | None = None, config: str | None = None, atol: float = 0.0,
         progress: bool = False) -> DiffReport:
    """Compare two checkpoints of any formats and topologies, tensor by tensor, as `reshard diff` does.

    Args:
        a, b: two checkpoints' paths, or their Catalogs.
        tag_a, tag_b: the tags to read, for DeepSpeed save dirs.
        layout_rules: as for open_checkpoint; it goes to whichever side's format takes it.
        config: as for open_checkpoint; it goes to each side whose format takes it.
        atol: the largest absolute difference still equal.
        progress: a bar of the bytes read on stderr, where it is a terminal.

    Returns:
        A DiffReport: `equal`, `differences` (each with its `line()`), `notes`; `to_dict()` is what
        `reshard diff --json` prints.

    Example:
        >>> report = reshard.diff("ckpt/", "ckpt/")
        >>> report.equal, report.compared > 0
        (True, True)
    """
    from reshard.commands.diff import diff as compare
    sides = [(a, tag_a), (b, tag_b)]
    # --layout-rules go to whichever side's format takes them (a tensor-parallel save compared with its export);
    # refused, as by any reader, only when neither takes them: A's reader says so in one line
    rules = [layout_rules if layout_rules and not isinstance(side, Catalog) and
             takes(os.fspath(side), side_tag, "layout_rules") else None for side, side_tag in sides]
    if layout_rules and not any(rules):
        rules[0] = layout_rules
    configs = [config if config and not isinstance(side, Catalog) and takes(os.fspath(side), side_tag, "config")
               else None for side, side_tag in sides]
    if config and not any(configs):
        configs[0] = config
    catalog_a, catalog_b = (_catalog(side, side_tag, r, c) for (side, side_tag), r, c
                            in zip(sides, rules, configs, strict=True))
    return compare(catalog_a, catalog_b, atol=atol, progress=progress)


def _catalog(source, tag: str | None, layout_rules: str | None, config: str | None = None,
             model_order: bool = True) -> Catalog:
    return source if isinstance(source, Catalog) else \
        open_checkpoint(source, tag, layout_rules, config, model_order=model_order)


def _complete(source, tag: str | None, layout_rules: str | None, config: str | None = None,
              names: str | None = None) -> Complete:
    """`source` proven whole; read without the model's own param order where `names` names every param itself."""
    return source if isinstance(source, Complete) else \
        prove_catalog_complete(_catalog(source, tag, layout_rules, config, not names_every_param(names)))


def _execute(made, dst, memory_budget: int | None, **options) -> Written | None:
    """Under torchrun the ranks share the files of one plan; otherwise this process writes them all."""
    from reshard.execution.distributed import Solo, TorchGroup, launched_by_torchrun
    from reshard.execution.executor import DEFAULT_MEMORY_BUDGET, execute
    group = TorchGroup() if launched_by_torchrun() else Solo()
    try:
        return execute(made, os.fspath(dst), group=group, memory_budget=memory_budget or DEFAULT_MEMORY_BUDGET,
                       **options)
    finally:
        group.close()


def _run_directory_hint(path: str) -> ReshardError | None:
    """A run directory given where one checkpoint is expected: the error points at `reshard list`."""
    if not fs.isdir(path):
        return None
    try:
        found = scan(path).entries
    except ReshardError:
        return None
    if not found:
        return None
    names = ", ".join(sorted(e.name for e in found)[:3]) + (", ..." if len(found) > 3 else "")
    return UnknownFormatError.at(path, f"a run directory of {len(found)} checkpoint{'s' * (len(found) != 1)} "
                                       f"({names}), not one checkpoint: `reshard list {path}` shows them")
