"""export: the checkpoint as one consolidated state dict, plus its optimizer state on request.

An export is a conversion to a single rank in another container: the same planner and executor
move the bytes. Weights come from the fp32 master copy (or the saved 16-bit copy with
`weights="module"`), cast to the chosen dtype — by default ("auto") the training precision, what the model
holds and `save_pretrained` writes (the 16-bit copy of a mixed-precision run is its master rounded to nearest
even, so the cast master is that copy bit for bit); frozen params and persistent buffers are included
(integer buffers keep their dtype); a tied weight is written once and recorded. Large outputs
follow Hugging Face's sharded convention.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from reshard.commands.inspect import jsonable
from reshard.commands.validate import Complete
from reshard.core.catalog import MASTER, MODULE, Catalog, ScalarTensor, TensorKey
from reshard.core.dtypes import SHORT, is_floating
from reshard.core.layout import Layout
from reshard.core.placement import Shard
from reshard.core.planner import Plan, plan
from reshard.core.write_requests import CopiedFile, NewTensor, Output, TensorFile, TextFile
from reshard.errors import ReshardError, UsageError
from reshard.formats.containers import EXPORTS
from reshard.formats.hf import sharding as hf
from reshard.rules import export_names
from reshard.storage import files as fs

FORMATS = EXPORTS     # container name -> its file type: from_entries, STEM, EXTENSION, SUFFIXES
OPTIMIZER_JSON = "optimizer.json"
WITH_OPTIMIZER = "the optimizer state (--with-optimizer)"    # optimizer.json keeps one step per param group


@dataclass(frozen=True)
class Entry(NewTensor):
    """A tensor of the export: its name (the key), dtype and shape, and the logical tensor it copies, from its
    flat element `start` (a slab of it, where export names split a tensor), or the `shard` of it (boxes of it, where
    export names cut interleaved parts: a fused QKV's q, k, v)."""
    source: tuple = ()
    start: int = 0
    shard: Shard | None = None


@dataclass(frozen=True)
class ExportPlan:
    """An export's plan, and whether it writes OUT as one file (else a folder of them)."""
    plan: Plan
    single_file: bool


def export_plan(complete: Complete, out: str, *, dtype: str = "auto", max_shard_size: str | None = None,
                with_optimizer: bool = False, fmt: str | None = None, weights: str = "master",
                names: str | None = None, config: str | None = None) -> ExportPlan:
    """The files of the export; single_file when OUT names one file. `fmt`:
    safetensors or torch; by default the one OUT's suffix names (safetensors for a directory). `names`: an
    export-names rule file (reshard.rules.export_names) saying how the consumer names and cuts the weights. `config`:
    the model's config.json (Hugging Face's), for a checkpoint that holds none (torchtitan's): written beside the
    weights in a folder, and its values answer the rules' counts by name (head_dim) where the save records none.
    `complete`: the proof that the checkpoint is whole (reshard.commands.validate.prove_complete)."""
    catalog = complete.catalog
    fmt = export_format(out, fmt)
    if dtype not in ("auto", *SHORT):
        raise ReshardError(f"unknown dtype {dtype!r} (fp32, bf16, fp16 or auto)")
    if weights not in ("master", "module"):
        raise ReshardError(f"unknown weights {weights!r} (master or module)")
    file_type = FORMATS[fmt]
    single_file = out.endswith(file_type.SUFFIXES) and max_shard_size is None
    if single_file and with_optimizer:
        raise ReshardError.at(out, "--with-optimizer writes several files; give a directory")
    if with_optimizer:
        if names:      # optimizer.json names params as the checkpoint does
            raise UsageError.at(names, "export names apply to the weights; export the optimizer state without them")
        catalog.scalars_of_groups(WITH_OPTIMIZER)
    entries = weight_entries(catalog, None if dtype == "auto" else SHORT[dtype], weights)
    aliases = dict(catalog.aliases)
    rules = export_names.load(names) if names else None
    facts = catalog.notes.hyperparameters() if isinstance(catalog.notes, export_names.ModelFacts) else None
    given = hf.model_config(config) if config else None
    if given is not None:
        facts = {**given, **(facts or {})}      # the save's own record first
    if rules is not None:
        entries, aliases = rules.apply(entries, aliases, facts)
    metadata = {"format": "pt"}
    if aliases:
        metadata["tied"] = json.dumps(aliases)
    targets: list[TensorFile | TextFile | CopiedFile]
    if single_file:
        targets = [file_type.from_entries(os.path.basename(out), entries, aliases, metadata)]
    else:
        targets = _sharded(file_type, file_type.STEM, entries, aliases, metadata,
                           max_shard_size or hf.DEFAULT_MAX_SHARD_SIZE)
    if with_optimizer:
        for state in optimizer_sets(catalog, entries):
            state_entries = [Entry(p.name, catalog.tensors[TensorKey(p.name, state)].dtype, p.shape, (p.name, state))
                             for p in catalog.params.values() if p.kind == "trainable"]
            targets += _sharded(file_type, f"optimizer-{state}", state_entries, {}, {"format": "pt"},
                                max_shard_size or hf.DEFAULT_MAX_SHARD_SIZE)
        targets.append(TextFile(OPTIMIZER_JSON, json.dumps(optimizer_summary(catalog, entries, fmt), indent=2) + "\n"))
    if not single_file:         # config, tokenizer: a folder from_pretrained loads
        targets += [CopiedFile(os.path.basename(p), p, fs.getsize(p)) for p in catalog.model_files]
        if config:
            if any(t.path == MODEL_CONFIG for t in targets):
                raise UsageError.at(config, f"the checkpoint has its own {MODEL_CONFIG}")
            targets.append(CopiedFile(MODEL_CONFIG, config, fs.getsize(config)))
        if rules is not None and rules.config is not None:      # a config the rules build from the save's values
            if any(t.path == rules.config.file for t in targets):
                raise ReshardError.at(rules.path, f"the checkpoint has its own {rules.config.file}")
            targets.append(TextFile(rules.config.file, rules.config_text(facts)))
    target = Layout.of(1, dtype=entries[0].dtype if entries else "float32")
    return ExportPlan(plan(catalog, target, targets, catalog.tag, Output(fmt)), single_file)


MODEL_CONFIG = "config.json"       # what from_pretrained reads beside the weights


def export_format(out: str, fmt: str | None) -> str:
    """`fmt`, or the format OUT's suffix names; refused when the two disagree (an `x.bin` written as a
    safetensors directory surprises everyone)."""
    if fmt is not None and fmt not in FORMATS:
        raise ReshardError(f"unknown export format {fmt!r} (safetensors or torch)")
    named = [name for name, file_type in FORMATS.items() if out.endswith(file_type.SUFFIXES)]
    if fmt is None:
        return named[0] if named else "safetensors"
    if named and fmt not in named:
        suffixes = "/".join(FORMATS[fmt].SUFFIXES)
        raise UsageError.at(out, f"the name says {named[0]}, --format says {fmt}; name a {suffixes} file, a directory, "
                                 "or leave --format out")
    return fmt


def weight_entries(catalog: Catalog, dtype: str | None, weights: str) -> list:
    """One entry per state_dict key that holds data (tied aliases excluded), in model order."""
    out = []
    for key in catalog.tensor_order():
        if key in catalog.aliases:
            continue
        p = catalog.params[key]
        if p.kind == "trainable":
            # (a weights-only checkpoint, `reshard thin`'s, has no master: its module copy is the weights)
            use_module = (weights == "module" and (key, MODULE) in catalog.tensors) or \
                (key, MASTER) not in catalog.tensors
            source = (key, MODULE) if use_module else (key, MASTER)
        else:
            source = (key, MODULE)
        saved = catalog.tensors[TensorKey(*source)].dtype
        if not is_floating(saved):
            target = saved                      # integer buffers keep their type
        elif dtype is not None:
            target = dtype
        else:                                   # auto: the training precision; buffers as saved
            target = saved if p.kind == "buffer" else (catalog.layout.dtype or saved)   # "": mixed, unknown
        out.append(Entry(key, target, tuple(p.shape), source))
    return out


def optimizer_sets(catalog: Catalog, entries: list[Entry]) -> list[str]:
    """State names exported with --with-optimizer; the fp32 master too unless the weights are it."""
    masters_exported = all(e.source[1] == MASTER and e.dtype == "float32"
                           for e in entries if catalog.params[e.key].kind == "trainable")
    return ([] if masters_exported else [MASTER]) + catalog.optimizer_states()


def optimizer_summary(catalog: Catalog, entries: list[Entry], fmt: str) -> dict[str, Any]:
    extension = FORMATS[fmt].EXTENSION
    groups = []
    per_group = catalog.scalars_of_groups(WITH_OPTIMIZER)
    for g, group in enumerate(catalog.param_groups):
        scalars = per_group[g] if g < len(per_group) else {}
        groups.append({**{k: jsonable(v) for k, v in group.items() if k != "params"},
                       **{k: (v.value if isinstance(v, ScalarTensor) else jsonable(v)) for k, v in scalars.items()},
                       "params": list(group["params"])})
    sets = optimizer_sets(catalog, entries)
    return {
        "optimizer": catalog.contents().optimizer,
        "states": {s: f"optimizer-{s}.{extension}" for s in sets},
        "master_weights": f"optimizer-{MASTER}.{extension}" if MASTER in sets else "the exported model weights",
        "param_groups": groups,
        "global_steps": catalog.training.global_steps,
        "global_samples": catalog.training.global_samples,
        "skipped_steps": catalog.training.skipped_steps,
        "lr_scheduler": jsonable(catalog.training.lr_scheduler),
        "source": catalog.root,
    }


def _sharded(file_type, stem, entries, aliases, metadata, max_shard_size) -> list:
    extension = file_type.EXTENSION
    by_name = {e.key: e for e in entries}
    groups = hf.shard([(e.key, e.nbytes) for e in entries], max_shard_size)
    names = hf.shard_names(stem, extension, len(groups))
    files, weight_map = [], {}
    for filename, members in zip(names, groups, strict=True):
        tied = {a: s for a, s in aliases.items() if s in members}
        file = file_type.from_entries(filename, [by_name[n] for n in members], tied, metadata)
        files.append(file)
        for name in members + [alias for alias in tied if file.holds(alias)]:
            weight_map[name] = filename
    if len(groups) > 1:
        files.append(TextFile(f"{names[0].split('-00001-of-')[0]}.{extension}.index.json",
                              hf.index(sum(e.nbytes for e in entries), weight_map)))
    return files
