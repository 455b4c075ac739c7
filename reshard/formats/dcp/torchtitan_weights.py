"""torchtitan's weights-only form: what its CheckpointManager writes at the last step with
`checkpoint.last_save_model_only` (torchtitan 0.3.0, components/checkpointer/dcp.py `_save_last_step`): `dcp.save` of
the model's state dict alone (`ModelWrapper.state_dict()`: the bare FQNs, planner path (fqn,)) in `step-N/`, cast to
`checkpoint.export_dtype` (float32 by default; written here in the dtype the model holds its weights in, which is
that export for a float32 model). Its optimizer, LR schedulers, data loaders and train state are not saved.

torchtitan loads such a folder as it loads any model-only checkpoint: `CheckpointManager.load()` with
`checkpoint.initial_load_path` naming it and `checkpoint.initial_load_model_only` (its default), `dcp.load` of the
model's state dict alone (`_states_to_load(model_only=True)`); a resume (`load(step=N)` in its own folder) asks
for the optimizer and fails on it.
"""
from __future__ import annotations

from reshard.core.catalog import Catalog
from reshard.errors import ReshardError
from reshard.formats.dcp import weights_only
from reshard.formats.weights_only import Form

LOAD = ("torchtitan's CheckpointManager.load() with checkpoint.initial_load_path=<step-N> and "
        "checkpoint.initial_load_model_only=true")


def form(catalog: Catalog, path: str, keep_masters: bool) -> Form:
    """The step-N folder `path` written again as the model's state dict alone."""
    weights_only.check_full(catalog, path)
    model, master = catalog.weight_dtypes()
    if keep_masters and master and model != master:
        raise ReshardError.at(path, f"--keep-masters: torchtitan's model holds its {model} weights; writing its "
                                    "fp32 masters there is not built")
    return Form((), weights_only.replaced(catalog), "the optimizer state, LR schedulers, data loaders and train state: "
                                                    "the model's state dict written alone", LOAD,
                tuple(weights_only.model_files(catalog, None)))
