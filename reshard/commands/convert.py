"""convert: source checkpoint + target spec -> Plan -> files. The steps in order, nothing more."""
from __future__ import annotations

import os

from reshard import paths
from reshard.commands.validate import Complete, prove_complete
from reshard.core.catalog import Catalog
from reshard.core.layout import Layout, spec_keys
from reshard.core.planner import Plan, joined, plan
from reshard.errors import ReshardError, UsageError
from reshard.formats import (
    FRESH,
    default_tag,
    descriptor_layout,
    framework_dispositions,
    rank_state,
    registry,
    spec_keys_of,
    target_layout as spec_layout,
    with_framework,
)
from reshard.formats.framework import framework_of
from reshard.rules import files as rule_files
from reshard.storage import files as fs


def target_layout(catalog: Catalog, to: str, fmt: str | None = None) -> Layout:
    """`to` is a spec ("dp=4,zero=3") or a layout descriptor file (a path, or the name of one shipped with reshard:
    "dp4-zero3"), read for an output of format `fmt` (default: the source's); degrees either leaves out keep the
    source's."""
    source, format_name = catalog.layout, fmt or catalog.format
    if fs.isfile(to):
        return descriptor_layout(source, to, format_name)
    if to and "=" not in to:     # every key of a spec is key=value: this names a file
        descriptor = rule_files.find(to, rule_files.LAYOUT)
        if not fs.isfile(descriptor):
            raise UsageError.at(to, "no such layout descriptor file (a topology spec is key=value, e.g. dp=4,zero=3)")
        return descriptor_layout(source, descriptor, format_name)
    return spec_layout(source, to, format_name)


def make_plan(source: Catalog | Complete, to: str, tag_out: str | None = None, fmt: str | None = None,
              new_rank_state: str = FRESH, names: str | None = None) -> Plan:
    """The plan writing the checkpoint at topology `to` in format `fmt` (default: the source's format); with a
    training framework's files around the source, those too (`new_rank_state`: what a process the source lacks
    gets). A Catalog is proven whole first (prove_complete); a Complete is that proof, made before. `names`: a
    module-names rule file (reshard.rules.module_names) putting the params under the names and shapes of the model that
    loads the output (an AutoEP Mixtral's experts as transformers' Mixtral holds them), or, for output in a format
    that saves under names of its own (Megatron's torch_dist keys) from a source of another, undone: the module's
    names the source holds brought back to that format's; or an export-names rule file (reshard.rules.import_names),
    read backwards: a model published under its consumer's names (a Hugging Face Llama) under the checkpoint's the rule
    file exports from, its hyperparameters from the model's config."""
    complete = source if isinstance(source, Complete) else prove_complete(source)
    another = fmt is not None and fmt != complete.catalog.format
    own_names = another and _writer(complete.catalog, fmt).SAVES_OWN_NAMES
    # a published model (a Hugging Face folder) under its consumer's names, brought back to the checkpoint's
    # (Megatron's torch_dist keys, torchtitan's FQNs: whatever the export-names file maps from)
    if names and another and names_every_param(names) and registry.entry(complete.catalog.format).published:
        from reshard.rules import import_names
        complete = prove_complete(import_names.load(names, complete.catalog))
    elif names:
        from reshard.rules import module_names
        rules = module_names.load(names)
        if own_names:
            rules = module_names.inverted(rules)
        complete = prove_complete(rules.apply(complete.catalog))
    catalog = complete.catalog
    target = target_layout(catalog, to, fmt)    # (a bad spec is refused here)
    if "=" in to and not fs.isfile(to):     # a spec (a descriptor file says only what it means)
        _refuse_keys_without_meaning(catalog, to, fmt)
    return plan_for(complete, target, tag_out, fmt, new_rank_state)


def names_every_param(names: str | None) -> bool:
    """Is `names` an export-names rule file, which names every param of the output itself (its names, the writer's
    order, a tie from the model's config), so a convert with it needs the source's own param order and ties not
    (formats.read's model_order)?"""
    return names is not None and rule_files.kind_of(names, (rule_files.MODULE_NAMES, rule_files.EXPORT_NAMES)) == \
        rule_files.EXPORT_NAMES


def _refuse_keys_without_meaning(catalog: Catalog, spec: str, fmt: str | None) -> None:
    """A `--to` key the output format has no place for (a ZeRO stage for DCP) is a usage error, not ignored; the
    line names the --format that takes it."""
    from reshard.formats import formats_taking
    _writer(catalog, fmt)       # (a source no writer writes needs a --format)
    honoured = spec_keys_of(fmt or catalog.format)
    unused = sorted(spec_keys(spec) - set(honoured))
    if unused:
        taking = formats_taking(unused)
        where = f"; --format {' or '.join(taking)} takes {' and '.join(unused)}" if taking else ""
        raise UsageError(f"--to {spec}: {fmt or catalog.format} output has no {' or '.join(unused)} "
                         f"(it is written at {', '.join(honoured)}){where}")


def plan_for(complete: Complete, target: Layout, tag_out: str | None = None, fmt: str | None = None,
             new_rank_state: str = FRESH) -> Plan:
    """make_plan's plan at layout `target`, for a catalog proven whole."""
    catalog = complete.catalog
    target_format = _writer(catalog, fmt)
    tag = tag_out or target_format.output_tag(catalog, catalog.tag or default_tag(catalog))
    why = paths.escape(tag, single=True)
    if why:     # a tag is one folder of the output: `../x` or an absolute path would put the rank files elsewhere
        raise UsageError(f"--tag-out {tag!r}: {why}; a tag is one folder name inside DST" if tag_out else
                         f"{catalog.root}: tag {tag!r}: {why}; name the output's tag with --tag-out")
    save_dir = os.path.dirname(catalog.root)
    if catalog.experts is not None and not target_format.PLACES_EXPERTS:   # it would write experts as dense params
        from reshard.formats import WRITERS, writer
        placing = " or ".join(name for name in WRITERS if writer(name).PLACES_EXPERTS)
        shipped = rule_files.names(rule_files.MODULE_NAMES, "experts")
        raise ReshardError.at(catalog.root, f"converting mixture-of-experts checkpoints to {fmt or catalog.format} "
                                            "needs --names RULES, the names of a model holding every expert "
                                            f"(shipped RULES: {shipped}); to {placing} it needs none; export reads "
                                            "them")
    targets = with_framework(catalog, fmt or catalog.format, target.world_size, new_rank_state,
                             target_format.target_files(catalog, target, tag, save_dir))
    if target_format.OWN_RANK_STATE:     # the per-process files it keeps of its own, of the processes the source lacked
        targets += target_format.rank_state_files(catalog, target, new_rank_state)
    made = plan(catalog, target, targets, tag, target_format.describe(target, tag))
    if not catalog.companions:
        return made
    if fmt is not None and fmt != catalog.format:
        folder = catalog.companion_folders()[0][0]
        raise ReshardError.at(catalog.root, f"a checkpoint of several models ({folder}/ beside this one) is written "
                                            f"in its own format only: convert each model's folder on its own for "
                                            f"--format {fmt}")
    # each other model of the checkpoint (a verl step's critic) at the same target, under its own folder
    return joined(made, [(folder, plan_for(prove_complete(each), each.layout.with_degrees(target.degrees), tag, fmt,
                                           new_rank_state)) for folder, each in catalog.companion_folders()])


def framework_files(catalog: Catalog, target: Layout, fmt: str | None, new_rank_state: str = FRESH) -> tuple:
    """What becomes of each file of the training framework around the source (Disposition), or of each per-process
    file the writer keeps of its own (verl's extra state), for plan and convert."""
    own = rank_state(catalog, fmt or catalog.format, target, new_rank_state)
    return own[1] if own is not None else \
        framework_dispositions(catalog, fmt or catalog.format, target.world_size, new_rank_state)


def batch_size_advice(catalog: Catalog, target: Layout, fmt: str | None = None) -> str | None:
    """What happens to the global batch size when dp changes, and how to keep it (format-specific)."""
    advice = _writer(catalog, fmt).batch_size_advice(catalog, target)
    frame = framework_of(catalog)
    return frame.batch_advice(advice) if frame is not None else advice


def _writer(catalog: Catalog, fmt: str | None):
    """The writer of format `fmt`, by default the source's own; a source of a format no writer writes needs one."""
    from reshard.formats import WRITERS, writer
    if fmt is None and catalog.format not in WRITERS:
        raise UsageError.at(catalog.root, f"{catalog.format} checkpoints are read, not written: name the output's "
                                          f"format with --format ({', '.join(WRITERS)})")
    why = registry.not_written_as(catalog.format, fmt) if fmt is not None and fmt != catalog.format else None
    if why is not None:
        raise ReshardError.at(catalog.root, f"a {catalog.format} checkpoint is not converted to --format {fmt}: {why}")
    return writer(fmt or catalog.format)
