"""DeepSpeed's weights-only form: what `engine.load_checkpoint(dir, load_module_only=True)` accepts.

ZeRO-1/2: the module files (`mp_rank_*_model_states.pt`, a PipelineModule's layer files) hold the weights in the
training dtype beside the engine's own state (steps, scheduler, client state, config); the optimizer's files
(`*_optim_states.pt`: fp32 masters and moments) are dropped. The engine's module-only load reads the module files
alone (`_load_checkpoint`, then `refresh_fp32_params`), so the tag folder less its optimizer files loads.

ZeRO-3: the module files hold no weights (placeholders). With `load_optimizer_states=False` DeepSpeed 0.19.8's
`_load_checkpoint` replaces them by `get_fp32_state_dict_from_zero_checkpoint(load_dir)`: zero_to_fp32 reads the
model files' shapes and each `*_optim_states.pt` file's fp32 partitions, stage and partition count, and drops the
torch optimizer's state dict (the moments) unread. So the form keeps the model files and writes each optimizer file
again through the ZeRO-3 writer at the save's own topology, weights-only: the partitions without the moments
(about a third of an Adam run's files). (With `load_optimizer_states=True` the module-only load takes no weights
from any ZeRO-3 checkpoint, full or not: `_restore_from_bit16_weights` keeps the initialised ones.) That call
ignores the tag it is given and reads the one `dir/latest` names, so a thinned ZeRO-3 tag loads from a folder whose
`latest` names it.
"""
from __future__ import annotations

import dataclasses
import os

from reshard.core.catalog import Catalog
from reshard.errors import ReshardError
from reshard.formats.deepspeed import files as names, topology, writer
from reshard.formats.weights_only import Form
from reshard.storage import files as fs

LOAD = "engine.load_checkpoint(dir, tag, load_module_only=True, load_optimizer_states=False)"
LOAD_ZERO3 = (f"{LOAD}, dir/latest naming tag (DeepSpeed 0.19.8 takes a ZeRO-3 save's weights from the tag "
              "`latest` names, whatever tag is passed)")


def form(catalog: Catalog, path: str, keep_masters: bool) -> Form:
    """The tag folder `path` less its optimizer files (ZeRO-1/2), or with them written again without the moments
    (ZeRO-3)."""
    tag_dir = fs.normpath(fs.abspath(path))
    if tag_dir != fs.normpath(catalog.root):
        raise ReshardError.at(path, f"thin a DeepSpeed save's tag folder ({os.path.basename(catalog.root)}), "
                                    "as `reshard list` shows it")
    listing = sorted(fs.listdir(tag_dir))
    optim = tuple(n for n in listing if names.OPTIM_STATES.match(n))
    if not optim:
        raise ReshardError.at(path, "no *_optim_states.pt files: nothing to thin")
    kept = tuple(n for n in listing if n not in optim and fs.isfile(os.path.join(tag_dir, n)))
    if topology.of(catalog.layout).zero == 3:
        return _zero3(catalog, path, kept, optim)
    if keep_masters and _mixed_precision(catalog):
        raise ReshardError.at(path, "--keep-masters: DeepSpeed's module files hold the 16-bit weights of this "
                                    f"{catalog.layout.dtype} run; writing its fp32 masters there is not built (thin "
                                    "without --keep-masters keeps the weights it trains with)")
    return Form(kept, optim, f"the optimizer state ({len(optim)} *_optim_states.pt files: fp32 masters and "
                             "moments)", LOAD)


def _zero3(catalog: Catalog, path: str, kept: tuple[str, ...], optim: tuple[str, ...]) -> Form:
    """The model files kept, each optimizer file written again with its fp32 partitions alone (the masters: the
    weights this form holds, whatever --keep-masters says)."""
    own = topology.of(catalog.layout)
    if own.weights_only:
        raise ReshardError.at(path, "already weights-only (its *_optim_states.pt files hold no moments)")
    if catalog.experts is not None:
        raise ReshardError.at(path, "a ZeRO-3 mixture-of-experts save: DeepSpeed's module-only load does not take "
                                    "its experts from the fp32 partitions, so its weights-only form is not built")
    target = dataclasses.replace(catalog.layout, format_topology=dataclasses.replace(own, weights_only=True))
    prefix = f"{catalog.tag}/"
    written = tuple(dataclasses.replace(f, path=f.path[len(prefix):])
                    for f in writer.target_files(catalog, target, catalog.tag)
                    if f.path.startswith(prefix) and names.OPTIM_STATES.match(f.path[len(prefix):]))
    if sorted(f.path for f in written) != sorted(optim):
        raise ReshardError.at(path, f"its {len(optim)} *_optim_states.pt files are not those of its own topology "
                                    f"({catalog.layout.topology()}): not thinned")
    moments = ", ".join(catalog.optimizer_states()) or "none"
    return Form(kept, optim, f"the optimizer state ({moments}; the {len(optim)} *_optim_states.pt files written "
                             "again with the fp32 partitions alone)", LOAD_ZERO3, written)


def _mixed_precision(catalog: Catalog) -> bool:
    model, master = catalog.weight_dtypes()
    return bool(master) and model != master
