"""The weights-only form of FSDP's sharded save in a framework's folder (HF Trainer's checkpoint-N/, Accelerate's
save_state dir): the folder less the optimizer's DCP folder `optimizer_0/`, every other file kept as it is (the
model's `pytorch_model_fsdp_0/`, the framework's trainer state, scheduler, RNG and custom-object files: small).

Neither framework writes this form itself (the Trainer refuses `save_only_model` with SHARDED_STATE_DICT), but each
one's own load takes it, the model alone (observed in transformers 5.21 and accelerate 1.16):
- the Trainer's resume, `train(resume_from_checkpoint=)`: `_load_from_checkpoint` loads `pytorch_model_fsdp_0/`
  (accelerate's load_fsdp_model), then `_load_optimizer_and_scheduler` loads the optimizer and the scheduler only
  where a folder named `optimizer*` is there, and skips both without a word where none is;
- Accelerate's `load_state(dir)` loads the optimizers and schedulers that were prepared (load_fsdp_optimizer of
  `optimizer_0/`), so with the model alone prepared it loads the model (load_fsdp_model), the RNG states and the
  registered objects.
"""
from __future__ import annotations

import os

from reshard.core.catalog import Catalog
from reshard.errors import ReshardError
from reshard.formats.framework.fsdp import OPTIM_DIR
from reshard.formats.weights_only import Form
from reshard.storage import files as fs


def form(catalog: Catalog, path: str, load: str) -> Form:
    """The framework's folder `path` (FSDP sharded, `catalog` read from it) less `optimizer_0/`; `load`: the
    framework's load that takes it."""
    folder = fs.normpath(fs.abspath(path))
    if folder != fs.normpath(catalog.root):
        raise ReshardError.at(path, f"thin the framework's folder ({os.path.basename(catalog.root)}), as `reshard "
                                    "list` shows it")
    found = sorted(os.path.relpath(p, folder) for p, _, _ in fs.tree(folder).files_under(folder))
    dropped = tuple(n for n in found if n.split(os.sep, 1)[0] == OPTIM_DIR)
    if not dropped:
        raise ReshardError.at(path, f"no {OPTIM_DIR}/: nothing to thin")
    kept = tuple(n for n in found if n not in dropped)
    return Form(kept, dropped, f"the optimizer state ({OPTIM_DIR}/: FSDP's sharded optimizer state dict, "
                               f"{len(dropped)} files)", load)
