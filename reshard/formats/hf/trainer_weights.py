"""The Hugging Face Trainer's weights-only form: what `save_only_model=True` writes in `checkpoint-N/`.

Its `_save_checkpoint` (transformers 5.21) saves the model (save_pretrained: `model.safetensors` or its shards,
config.json, the tokenizer) and trainer_state.json, and skips `_save_optimizer_and_scheduler`: no `optimizer.pt`,
and with DeepSpeed no engine save (`latest`, the tag folder, `zero_to_fp32.py`). `from_pretrained` loads the
folder. The small files that are no optimizer state stay (scheduler.pt, rng_state*.pth, training_args.bin).

With FSDP's FULL_STATE_DICT, `save_model` writes model.safetensors from the gathered state dict and
`_save_optimizer_and_scheduler` (skipped) Accelerate's `pytorch_model_fsdp.bin` and `optimizer.bin` (save_fsdp_model,
save_fsdp_optimizer): both are dropped. With SHARDED_STATE_DICT the Trainer refuses `save_only_model` (its
create_accelerator_and_postprocess: "save_only_model option is not compatible with FSDP state dict type
'SHARDED_STATE_DICT'") and `save_model` writes no weights; its resume loads the folder less `optimizer_0/` as the
model alone (dcp/fsdp_weights.py), which is that folder's form.
"""
from __future__ import annotations

import os

from reshard.core.catalog import Catalog
from reshard.errors import ReshardError
from reshard.formats.dcp import fsdp_weights
from reshard.formats.deepspeed import files as ds_files, topology, zero_target
from reshard.formats.hf import files as hf_files, weights as hf_weights
from reshard.formats.hf.trainer import OPTIMIZER
from reshard.formats.weights_only import Form
from reshard.storage import files as fs

LOAD = "AutoModelForCausalLM.from_pretrained(checkpoint)"
SHARDED_LOAD = ("Trainer.train(resume_from_checkpoint=checkpoint) with FSDP's SHARDED_STATE_DICT (the model alone: "
                "without optimizer_0/ it loads neither optimizer nor scheduler)")
FSDP_FILES = (hf_files.FSDP_FULL_MODEL, hf_files.FSDP_FULL_OPTIMIZER)     # save_fsdp_model's, save_fsdp_optimizer's
ENGINE_FILES = (ds_files.LATEST, *zero_target.SCRIPTS)
ZERO3 = ("the Trainer's model files of a ZeRO-3 run hold no weights (placeholders, unless DeepSpeed gathers them with "
         "stage3_gather_16bit_weights_on_model_save), so its save_only_model form loads none: not thinned (reshard "
         "export writes its weights)")


def form(catalog: Catalog, path: str, keep_masters: bool) -> Form:
    folder = fs.abspath(path)
    if catalog.format == "fsdp":        # (fsdp_reader: pytorch_model_fsdp_0/ and optimizer_0/)
        return fsdp_weights.form(catalog, path, SHARDED_LOAD)
    weights = hf_weights.present(folder)
    if weights not in (hf_weights.SAFE, hf_weights.SAFE_INDEX, hf_weights.BIN, hf_weights.BIN_INDEX):
        raise ReshardError.at(path, "no model.safetensors or pytorch_model.bin the Trainer saved with the model: "
                                    "its weights-only form would hold no weights")
    if catalog.format == "deepspeed" and topology.of(catalog.layout).zero == 3:     # (model.safetensors: placeholders)
        raise ReshardError.at(path, ZERO3)
    model, master = catalog.weight_dtypes()
    if keep_masters and master and model != master:
        raise ReshardError.at(path, f"--keep-masters: the Trainer's model files hold the {model} weights of this "
                                    "run; writing its fp32 masters there is not built (thin without --keep-masters "
                                    "keeps the weights it trains with)")
    found = sorted(os.path.relpath(p, folder) for p, _, _ in fs.tree(folder).files_under(folder))
    engine = bool(ds_files.LATEST in found)
    dropped = tuple(n for n in found
                    if n in (OPTIMIZER, *FSDP_FILES) or (engine and (os.sep in n or n in ENGINE_FILES)))
    if not dropped:
        raise ReshardError.at(path, f"no {OPTIMIZER}, FSDP optimizer or DeepSpeed save in it: nothing to thin")
    kept = tuple(n for n in found if n not in dropped)
    fsdp = " and ".join(n for n in FSDP_FILES if n in dropped)
    what = "the DeepSpeed engine's save (its tag folder: optimizer state and module copy)" if engine else \
        f"FSDP's full optimizer state and model copy ({fsdp})" if fsdp else f"the optimizer state ({OPTIMIZER})"
    return Form(kept, dropped, what, LOAD)
