"""DeepSpeed's weights-only form: what `engine.load_checkpoint(dir, load_module_only=True)` accepts.

ZeRO-1/2: the module files (`mp_rank_*_model_states.pt`, a PipelineModule's layer files) hold the weights in the
training dtype beside the engine's own state (steps, scheduler, client state, config); the optimizer's files
(`*_optim_states.pt`: fp32 masters and moments) are dropped. The engine's module-only load reads the module files
alone (`_load_checkpoint`, then `refresh_fp32_params`), so the tag folder less its optimizer files loads.

ZeRO-3: the module files hold no weights (placeholders); with `load_optimizer_states=False` DeepSpeed 0.19.8's
`_load_checkpoint` replaces them by `get_fp32_state_dict_from_zero_checkpoint(load_dir)`, the fp32 partitions read
from the `*_optim_states.pt` files, and with `load_optimizer_states=True` it loads no weights from the checkpoint at
all (`_restore_from_bit16_weights`). No form short of those partitions is loaded, so ZeRO-3 saves are refused.
"""
from __future__ import annotations

import os

from reshard.core.catalog import Catalog
from reshard.errors import ReshardError
from reshard.formats.deepspeed import files as names, topology
from reshard.formats.weights_only import Form
from reshard.storage import files as fs

LOAD = "engine.load_checkpoint(dir, tag, load_module_only=True, load_optimizer_states=False)"
ZERO3 = ("a ZeRO-3 save's module files hold no weights, and DeepSpeed's module-only load takes them from the fp32 "
         "partitions in its *_optim_states.pt files, so no weights-only form is smaller: not thinned (reshard "
         "export writes its weights)")


def form(catalog: Catalog, path: str, keep_masters: bool) -> Form:
    """The tag folder `path` less its optimizer files."""
    tag_dir = fs.normpath(fs.abspath(path))
    if tag_dir != fs.normpath(catalog.root):
        raise ReshardError.at(path, f"thin a DeepSpeed save's tag folder ({os.path.basename(catalog.root)}), "
                                    "as `reshard list` shows it")
    if topology.of(catalog.layout).zero == 3:
        raise ReshardError.at(path, ZERO3)
    if keep_masters and _mixed_precision(catalog):
        raise ReshardError.at(path, "--keep-masters: DeepSpeed's module files hold the 16-bit weights of this "
                                    f"{catalog.layout.dtype} run; writing its fp32 masters there is not built (thin "
                                    "without --keep-masters keeps the weights it trains with)")
    listing = sorted(fs.listdir(tag_dir))
    dropped = tuple(n for n in listing if names.OPTIM_STATES.match(n))
    kept = tuple(n for n in listing if n not in dropped and fs.isfile(os.path.join(tag_dir, n)))
    if not dropped:
        raise ReshardError.at(path, "no *_optim_states.pt files: nothing to thin")
    return Form(kept, dropped, f"the optimizer state ({len(dropped)} *_optim_states.pt files: fp32 masters and "
                               "moments)", LOAD)


def _mixed_precision(catalog: Catalog) -> bool:
    model, master = catalog.weight_dtypes()
    return bool(master) and model != master
