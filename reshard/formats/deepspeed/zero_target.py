"""What every DeepSpeed file of a target needs beyond placements: the precision and ZeRO choices for the
target layout, the training state carried over from the source, and the small trees all ZeRO stages share."""
from __future__ import annotations

import copy
import os
from collections import OrderedDict
from typing import Any

from reshard.core.catalog import MASTER, MODULE, Catalog, ScalarTensor, ScalarValue
from reshard.core.layout import Layout
from reshard.core.write_requests import CopiedFile, Piece, TextFile
from reshard.formats.deepspeed import files as names, notes, standins, topology
from reshard.formats.deepspeed.rank_params import RankParam, RankParams
from reshard.formats.torchsave_read import Size
from reshard.formats.torchsave_write import TorchFileBuilder
from reshard.storage import files as fs

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000
SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
WRITES_DS_VERSION = "0.19.8"    # the DeepSpeed whose files this writer reproduces
TARGET = "a DeepSpeed checkpoint"   # which keeps one step per param group (base_optimizer_state)


class ZeroTarget:
    """The target layout's ZeRO and precision settings, and the source's optimizer hyper-parameters, scalars
    and training state: the same for every model-parallel rank."""

    def __init__(self, catalog: Catalog, target: Layout):
        self.catalog = catalog
        self.target = target
        self.dp = target.dp
        self.lp_dtype = target.dtype
        ds = topology.of(target)
        self.stage = ds.zero
        # the target's own DeepSpeed config when it is known (a live engine's: reshard.deepspeed_engine),
        # else the source's
        self.config: dict[str, Any] = copy.deepcopy(dict(ds.ds_config or notes.of(catalog).ds_config or {}))
        if self.config:
            self.config.setdefault("zero_optimization", {})["stage"] = ds.zero
            if "tensor_parallel" in self.config:     # AutoTP (a Megatron-style model cuts itself: no key)
                self.config["tensor_parallel"]["autotp_size"] = target.tp
        zero_cfg = self.config.get("zero_optimization") or {}
        self.bf16_prefix = self.lp_dtype == "bfloat16"
        grad_accum = ((self.config.get("data_types") or {}).get("grad_accum_dtype") or "").lower()
        self.bf16_optimizer = (ds.zero == 1 and self.lp_dtype == "bfloat16"
                               and (grad_accum in ("fp32", "float32", "float") or
                                    (ds.bf16_optimizer and not grad_accum)))
        self.elastic = ds.elastic and ds.zero in (1, 2) and not self.bf16_optimizer
        self.round_robin = bool(zero_cfg.get("round_robin_gradients", ds.round_robin_gradients))
        self.param_alignment = bool(zero_cfg.get("parameter_alignment", ds.parameter_alignment))
        sub_group_size = DEFAULT_SUB_GROUP_SIZE if ds.sub_group_size is None else ds.sub_group_size
        self.sub_group_size = int(zero_cfg.get("sub_group_size", sub_group_size))
        # a weights-only target (`reshard thin` of a ZeRO-3 save) keeps the fp32 partitions and no moment
        self.weights_only = ds.weights_only
        self.states = () if ds.weights_only else catalog.optimizer_states()
        # A source not saved by DeepSpeed names no version; DeepSpeed asserts one and refuses ZeRO-1
        # files older than 0.3.17, so say the version whose layout this writer follows.
        self.ds_version = notes.of(catalog).ds_version or WRITES_DS_VERSION
        self._scalars: list[dict[str, ScalarValue]] | None = None

    def scalars(self, g: int) -> dict:
        """Group g's optimizer scalars, one value each (the target was refused when a group's params differ)."""
        if self._scalars is None:
            self._scalars = self.catalog.scalars_of_groups(TARGET)
        return self._scalars[g] if g < len(self._scalars) else {}

    def hyper_params(self, g: int) -> dict:
        return {k: v for k, v in self.catalog.param_groups[g].items() if k != "params"}

    def loss_scaler_state(self) -> dict:
        """The ZeRO optimizer's global scalars, carried over (fresh defaults after a BF16_Optimizer)."""
        state = notes.of(self.catalog)
        scaler = state.loss_scaler
        if scaler is None:
            scaler = standins.LossScaler()
            scaler.__dict__.update(cur_scale=1.0, dynamic=False)
        return {"loss_scaler": scaler, "dynamic_loss_scale": state.dynamic_loss_scale,
                "overflow": state.overflow, "clip_grad": state.clip_grad}

    def saved_shape(self, shape: tuple) -> object:
        """A shape as the model states record it (param_shapes): a torch.Size."""
        return Size(shape)

    def model_states_tail(self, extra: dict) -> dict:
        """Training state of a model-states file, after the parameter bookkeeping keys; `extra`: the keys the
        engine adds for this mp rank (universal_checkpoint_info of an AutoTP model)."""
        state, training = notes.of(self.catalog), self.catalog.training
        tail = {"lr_scheduler": training.lr_scheduler, "data_sampler": state.data_sampler,
                "random_ltd": state.random_ltd}
        tail.update(skipped_steps=training.skipped_steps or 0, global_steps=training.global_steps or 0,
                    global_samples=training.global_samples, dp_world_size=self.dp,
                    mp_world_size=self.target.tp * self.target.pp,
                    checkpoint_parallel_dimensions={"pp_degree": self.target.pp, "tp_degree": self.target.tp},
                    ds_config=self.config, ds_version=self.ds_version)
        if training.global_samples is None:
            # unknown (a source that does not count samples): without the key the engine takes
            # global_steps x train_batch_size (engine.py _load_checkpoint), and inspect says unknown, not 0
            del tail["global_samples"]
        tail.update({k: v for k, v in extra.items() if k != "shared_params"})
        # a DeepSpeed source's client state; else what the framework around another backend kept (Lightning's meta.pt)
        frame = self.catalog.framework
        tail.update(state.client_state or (frame.state if frame is not None and frame.state else {}))
        return tail


def weight_source(param: RankParam) -> str:
    """The state a 16-bit module copy is filled from: the saved one if any, else the master copy (cast)."""
    return MODULE if param.module_dtype is not None else MASTER


def scalar_slot(file: TorchFileBuilder, value) -> object:
    """An optimizer scalar as saved: a one-element tensor of the file, or the plain value."""
    if isinstance(value, ScalarTensor):
        return file.slot(value.dtype, (), [Piece(1, value=value.value)])
    return value


def state_dict_entry(zt: ZeroTarget, file: TorchFileBuilder, g: int, lengths_by_state: dict) -> dict:
    """One optimizer state entry: scalars (step) first, then per-element states as slots."""
    entry = {key: scalar_slot(file, value) for key, value in zt.scalars(g).items()}
    for state, (length, pieces) in lengths_by_state.items():
        entry[state] = file.slot("float32", (length,), pieces)
    return entry


def module_tree(params: RankParams, make_slot) -> tuple:
    """The module state_dict in model order, a tied name sharing its source's tensor; and the slots."""
    module, slots, aliases = OrderedDict(), {}, dict(params.aliases)
    for key in params.order:
        source = aliases.get(key, key)
        if source not in slots:
            slots[source] = make_slot(params.by_name[source])
        module[key] = slots[source]
    return module, slots


def buffer_names(params: RankParams) -> list:
    return [p.name for p in params.of_kind("buffer")]


def closing_files(tag: str, source_save_dir: str | None) -> list:
    """`latest` and the source's consolidation scripts."""
    # the bare tag, as engine.save_checkpoint writes it
    out: list[TextFile | CopiedFile] = [TextFile(names.LATEST, tag)]
    if source_save_dir:
        for script in SCRIPTS:
            path = os.path.join(source_save_dir, script)
            if fs.isfile(path):
                out.append(CopiedFile(script, path, fs.getsize(path)))
    return out
