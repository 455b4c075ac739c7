#!/usr/bin/env python
"""Generate the DeepSpeed checkpoint fixtures in ``fixtures/`` with the real DeepSpeed engine (CPU, gloo).

Usage::

    python tools/make_fixtures.py [--only NAME[,NAME...]] [--out DIR] [--jobs N] [--list]

For every configuration this launches ``torchrun --nproc_per_node <dp> tools/make_fixtures.py --worker NAME``
(``--jobs`` launches at a time, default 2). Each worker trains ``tools/fixture_model.py`` with the real DeepSpeed
engine for 3 optimizer steps on deterministic data, saves ``<out>/<NAME>/checkpoint`` (tag ``global_step3``) and rank 0
writes beside it:

* ``truth.safetensors``: ``fp32/<param>`` (fp32 master weights), ``<state>/<param>`` (full optimizer state, e.g.
  ``exp_avg``/``exp_avg_sq``/``momentum_buffer``) for every trainable parameter, and ``module/<key>`` for every
  entry of the full module ``state_dict`` in its saved (16-bit under bf16/fp16) dtype;
* ``truth.json``: metadata (config, steps, param groups, trainable/frozen/tied/buffer names, lr scheduler, ...).

Truth source: ``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` under ZeRO-3; under
ZeRO-1/2 and BF16_Optimizer the values are read from the live flat buffers instead (the helpers are wrong under
``round_robin_gradients``); ``truth.json["helper_mismatch"]`` lists where the helpers disagree (max abs error).
Under fp32 the fp32 masters are asserted equal to the module weights.

Tensor/pipeline-parallel fixtures (``truth.json["kind"]`` ``autotp`` or ``pipe``, 4 ranks each; models and
truth assembly in ``tools/fixture_parallel.py``): ``autotp2_*`` train a tiny random ``transformers`` Llama with
``"tensor_parallel": {"autotp_size": 2}`` at dp=2 (ZeRO-1 fp32, ZeRO-1 bf16 tied embeddings, ZeRO-2 fp32 tied, ZeRO-1
fp32 with 3 key-value heads split 2+1) and also save ``hf_config/`` and ``logits.pt`` (the TP engine's logits on a
fixed probe); ``pipe2_z1_fp32_dp2`` trains a ``PipelineModule`` (tied embedding via ``TiedLayerSpec`` at both ends) at
pp=2, dp=2 with ``train_batch``, ``pipe2_tiedhead_z1_fp32_dp2`` one whose tied embedding is used again as the head
(a ``forward_fn``, no layer file) on the last stage, cut by DeepSpeed's default ``partition_method="parameters"``;
``megatron_tp2_z1_fp32_dp2`` trains a Megatron-style GPT (tools/fixture_megatron.py:
its own tensor-parallel layers through DeepSpeed's ``mpu`` interface, fused QKV, SwiGLU, padded vocab-parallel
embedding) whose checkpoint carries no ``universal_checkpoint_info``. Their truth holds the FULL tensors under the names
the checkpoint uses: TP shards are gathered over the TP group and put together with each parameter's own AutoTP affine
map; pipeline stages' dicts are gathered over the world (a tied weight's copies asserted equal). About 15-30 s per
fixture.

Mixture-of-experts fixtures (``kind`` ``autoep`` or ``moe``; tools/fixture_moe.py): ``autoep2_*`` train a tiny random
``transformers`` Mixtral (4 experts, top-2) with DeepSpeed AutoEP at ep=2 (ZeRO-1 fp32 and ZeRO-2 bf16 on 2 ranks,
ZeRO-2 fp32 at ep=2 x dp=2 on 4 ranks, also with ``use_data_before_expert_parallelism``; ZeRO-3 fp32 on 2 and 4
ranks, ``autoep2_z3_fp32`` and ``autoep2_z3_fp32_dp2``, experts partition-native; transformers 5.21.0, see
pyproject.toml), ``dsmoe_ep2_z2_fp32`` a small module around ``deepspeed.moe.layer.MoE`` (ep=2, ZeRO-2). Their truth
holds every expert in its global place (AutoEP's packed ``experts.w1/w2/w3`` as ``(num_experts, ...)`` tensors), and
``logits`` of a fixed probe; truth.json adds ``ep`` and ``num_experts``.

Determinism: truth files are bit-identical across reruns, and so are all checkpoint files except the ZeRO-3
``*_optim_states.pt`` files, whose ``fp32_flat_groups`` padding elements are uninitialised memory in DeepSpeed.
Environment: ``DS_ACCELERATOR=cpu`` and ``OMP_NUM_THREADS=1`` are set for the workers. fp16 configs override the
CPU accelerator's ``is_fp16_supported()`` check (no AVX512-FP16 needed; the on-disk format is device-independent).
"""

import argparse
import concurrent.futures
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torchrun_jobs

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_OUT = os.path.join(REPO, "fixtures")

STEPS = 3
MICRO_BATCH = 2
CLIENT_STATE = {"epoch": 1, "note": "reshard-fixture"}
LAUNCH_TIMEOUT = 600  # seconds per torchrun launch
RANK_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}

# --------------------------------------------------------------------------------------------------------------
# configurations


def _base_config(stage, dtype):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
        "gradient_clipping": 1.0,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-2,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": 0.01,
                # torch.optim implementation (FusedAdam needs a compiled op); DeepSpeed's "Adam" => AdamW mode
                "torch_adam": True,
            },
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 1e-3,
                "warmup_max_lr": 1e-2,
                "warmup_num_steps": 10,
                "warmup_type": "linear",
            },
        },
        "zero_optimization": {
            "stage": stage
        },
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def _configs():
    out = {}

    def add(name, stage, dtype, world, tied=False, frozen=False, two_groups=False, zero_extra=None, extra=None,
            save_step2=False):
        cfg = _base_config(stage, dtype)
        if zero_extra:
            cfg["zero_optimization"].update(zero_extra)
        if extra:
            for k, v in extra.items():
                cfg[k] = v
        out[name] = dict(name=name, stage=stage, dtype=dtype, world=world, tied=tied, frozen=frozen,
                         two_groups=two_groups, ds_config=cfg, save_step2=save_step2)

    for stage in (1, 2, 3):
        for dtype in ("fp32", "bf16"):
            for world in (2, 4):
                name = f"z{stage}_{dtype}_dp{world}"
                add(name, stage, dtype, world, save_step2=(name == "z2_fp32_dp2"))
    add("z2_fp16_dp2", 2, "fp16", 2)
    add("z1_bf16_frozen_tied_dp2", 1, "bf16", 2, tied=True, frozen=True, two_groups=True)
    add("z2_fp32_frozen_tied_dp2", 2, "fp32", 2, tied=True, frozen=True, two_groups=True)
    add("z3_fp32_frozen_tied_dp2", 3, "fp32", 2, tied=True, frozen=True, two_groups=True)
    add("z3_fp32_subgroup_dp2", 3, "fp32", 2, zero_extra={"sub_group_size": 300})
    add("z2_fp32_roundrobin_dp4", 2, "fp32", 4, zero_extra={"round_robin_gradients": True})
    add("bf16opt_z1_dp2", 1, "bf16", 2, extra={"data_types": {"grad_accum_dtype": "fp32"}})
    add("z2_fp32_sgd_dp2", 2, "fp32", 2,
        extra={"optimizer": {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.01}},
               "zero_allow_untested_optimizer": True})
    add("z2_fp32_elastic_dp2", 2, "fp32", 2, zero_extra={"elastic_checkpoint": True})
    add("z2_fp32_align_dp2", 2, "fp32", 2, zero_extra={"parameter_alignment": True})
    # tensor parallel (AutoTP, tiny HF Llama) and pipeline parallel (PipelineModule), 4 ranks each
    for stage, dtype, tied in ((1, "fp32", False), (1, "bf16", True), (2, "fp32", True)):
        name = f"autotp2_z{stage}_{dtype}{'_tied' if tied else ''}_dp2"
        add(name, stage, dtype, 4, tied=tied, extra={"tensor_parallel": {"autotp_size": 2}})
        out[name]["kind"] = "autotp"
        del out[name]["ds_config"]["scheduler"]
    add("autotp2_z1_fp32_uneven_dp2", 1, "fp32", 4, extra={"tensor_parallel": {"autotp_size": 2}})
    out["autotp2_z1_fp32_uneven_dp2"].update(kind="autotp", uneven=True)
    del out["autotp2_z1_fp32_uneven_dp2"]["ds_config"]["scheduler"]
    add("megatron_tp2_z1_fp32_dp2", 1, "fp32", 4, tied=True, extra={"gradient_clipping": 0.0})
    out["megatron_tp2_z1_fp32_dp2"]["kind"] = "megatron"
    add("pipe2_z1_fp32_dp2", 1, "fp32", 4, tied=True, extra={"gradient_accumulation_steps": 2})
    out["pipe2_z1_fp32_dp2"]["kind"] = "pipe"
    # the tied embedding used again as the head (a forward_fn: no layer file) on the last stage
    add("pipe2_tiedhead_z1_fp32_dp2", 1, "fp32", 4, tied=True, extra={"gradient_accumulation_steps": 2})
    out["pipe2_tiedhead_z1_fp32_dp2"].update(kind="pipe", model="tied_head")
    # tensor AND pipeline parallel: Megatron-style TP layers in a PipelineModule, tp2 x pp2 x dp2 (8 ranks)
    add("megatron_pipe_tp2_pp2_z1_fp32_dp2", 1, "fp32", 8, tied=True,
        extra={"gradient_accumulation_steps": 2, "gradient_clipping": 0.0})
    out["megatron_pipe_tp2_pp2_z1_fp32_dp2"]["kind"] = "megatron_pipe"
    # mixture of experts (tools/fixture_moe.py): AutoEP Mixtral at ep=2 (x dp=2 on 4 ranks), deepspeed.moe at ep=2
    autoep = {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}
    for stage, dtype, world, data_first in ((1, "fp32", 2, False), (2, "bf16", 2, False), (2, "fp32", 4, False),
                                            (2, "fp32", 4, True), (3, "fp32", 2, False), (3, "fp32", 4, False)):
        name = f"autoep2_z{stage}_{dtype}" + ("_dp2" if world == 4 else "") + ("_datafirst" if data_first else "")
        # data_first: the expert-data-parallel groups are consecutive ranks ([0, 1], [2, 3]), not strided
        extra = {"expert_parallel": dict(autoep),
                 **({"use_data_before_expert_parallelism": True} if data_first else {})}
        add(name, stage, dtype, world, extra=extra)
        out[name]["kind"] = "autoep"
        del out[name]["ds_config"]["scheduler"]
    add("dsmoe_ep2_z2_fp32", 2, "fp32", 2)
    out["dsmoe_ep2_z2_fp32"].update(kind="moe", ep=2)
    del out["dsmoe_ep2_z2_fp32"]["ds_config"]["scheduler"]
    return out


CONFIGS = _configs()

# --------------------------------------------------------------------------------------------------------------
# worker (runs under torchrun)


def _jsonable(v):
    import torch
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if torch.is_tensor(v):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if hasattr(v, "item"):  # numpy scalar
        return v.item()
    return repr(v)


def _number(v):
    import torch
    if torch.is_tensor(v):
        v = v.item()
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def _base_optimizer(engine):
    opt = engine.optimizer
    return getattr(opt, "optimizer", None) or opt


def _flat_truth(engine, base, names_by_id, state_names):
    """Full fp32 masters and optimizer states of a ZeRO-1/2 or BF16_Optimizer engine, read from the flat buffers.

    Every trainable 16-bit param is a view into its group's flat buffer; the offset of that view is where its
    elements sit in the (all-gathered) flat fp32 partition and in the flat optimizer states. This does not rely on
    DeepSpeed's fragment mappings (wrong under round_robin_gradients, defect B1).
    """
    import torch
    import torch.distributed as tdist
    opt = engine.optimizer
    if hasattr(opt, "bf16_groups_flat"):  # BF16_Optimizer
        lp_groups, lp_flats, hp_parts = opt.bf16_groups, opt.bf16_groups_flat, opt.fp32_groups_flat_partition
    else:  # DeepSpeedZeroOptimizer (stage 1/2)
        lp_groups, lp_flats, hp_parts = opt.bit16_groups, opt.bit16_groups_flat, opt.single_partition_of_fp32_groups
    out = {}
    for i, (lps, flat, hp) in enumerate(zip(lp_groups, lp_flats, hp_parts, strict=True)):
        group = opt.real_dp_process_group[i]
        world = tdist.get_world_size(group=group)
        assert hp.numel() * world == flat.numel(), (hp.numel(), world, flat.numel())

        def gather(t, world=world, group=group):     # bound here: the loop rebinds both
            parts = [torch.empty_like(t) for _ in range(world)]
            tdist.all_gather(parts, t.contiguous(), group=group)
            return torch.cat(parts).detach().float().cpu()

        full = {"fp32": gather(hp.data)}
        for s in state_names:
            full[s] = gather(base.state[hp][s])
        esize = flat.element_size()
        for p in lps:
            assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            off = (p.data_ptr() - flat.data_ptr()) // esize
            n = names_by_id[id(p)]
            for key, f in full.items():
                out[f"{key}/{n}"] = f[off:off + p.numel()].view(p.shape).clone().contiguous()
    return out


def allow_cpu_fp16(spec):
    """fp16 on CPU: DeepSpeed's CPU accelerator reports fp16 as unsupported unless oneDNN has native fp16
    kernels (AVX512-FP16/AMX); torch's CPU fp16 ops work regardless, and the checkpoint format does not
    depend on the device, so lift that capability check (it changes nothing of saving or loading)."""
    if spec["dtype"] == "fp16":
        from deepspeed.accelerator import get_accelerator
        acc = get_accelerator()
        if not acc.is_fp16_supported():
            acc.is_fp16_supported = lambda: True


def engine_truth(engine, spec):
    """(tensors, info) read from a live engine: what the fixture's truth files hold.

    A collective under ZeRO-3: every rank must call it. Also used by tests/scripts/engine_resume.py to read
    a resumed engine the same way.
    """
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from fixture_model import param_groups

    zero_stage = int(engine.zero_optimization_stage())
    group_names = param_groups(engine.module, two_groups=spec["two_groups"])[1]
    # ---------------- truth from the live engine (collectives: all ranks, same order) ----------------
    base = _base_optimizer(engine)
    if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
        # DeepSpeed 0.19.8 bug: ZeRO-1/2 link the optimizer-state fragments lazily right after the step of param
        # group 0, when group >= 1 has no state yet, and never relink; safe_get_full_optimizer_state then raises
        # "exp_avg not found" for params of group >= 1. Relink now that every group has state.
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    named = list(engine.module.named_parameters())
    trainable = [n for n, p in named if p.requires_grad]
    frozen = [n for n, p in named if not p.requires_grad]

    state_names, steps = [], []
    for st in base.state.values():
        for k, v in st.items():
            if k == "step":
                steps.append(_number(v))
            elif torch.is_tensor(v) and v.dim() > 0 and k not in state_names:
                state_names.append(k)
    assert len(set(steps)) <= 1, f"inconsistent step counts {steps}"

    pmap = dict(named)
    helper = {}
    for n in trainable:
        t = safe_get_full_fp32_param(pmap[n])
        assert t is not None, n
        helper[f"fp32/{n}"] = t.detach().float().cpu().clone().contiguous()
    for s in state_names:
        for n in trainable:
            t = safe_get_full_optimizer_state(pmap[n], s)
            assert t is not None, (n, s)
            helper[f"{s}/{n}"] = t.detach().float().cpu().clone().contiguous()

    # ZeRO-1/2 and BF16_Optimizer: independent truth from the flat buffers (see _flat_truth); the helpers are wrong
    # under round_robin_gradients, where they use the original instead of the round-robin flat order.
    helper_mismatch = {}
    if zero_stage in (1, 2):
        tensors = _flat_truth(engine, base, dict((id(p), n) for n, p in named), state_names)
        assert set(tensors) == set(helper), (sorted(tensors), sorted(helper))
        for k in tensors:
            if not torch.equal(tensors[k], helper[k]):
                helper_mismatch[k] = float((tensors[k] - helper[k]).abs().max())
    else:
        tensors = helper

    params = [p for _, p in named]
    if zero_stage == 3:
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            sd = engine.module.state_dict()
            sd = {k: v.detach().cpu().clone().contiguous() for k, v in sd.items()}
    else:
        sd = {k: v.detach().cpu().clone().contiguous() for k, v in engine.module.state_dict().items()}
    for k, v in sd.items():
        tensors[f"module/{k}"] = v
    if spec["dtype"] == "fp32":  # the module weights are the fp32 masters: must agree exactly
        for n in trainable:
            assert torch.equal(tensors[f"fp32/{n}"], sd[n]), f"fp32 master != module weight for {n}"

    pg = []
    opt_groups = engine.optimizer.param_groups
    assert len(opt_groups) == len(group_names), (len(opt_groups), len(group_names))
    for g, names in zip(opt_groups, group_names, strict=True):
        d = {k: _jsonable(v) for k, v in g.items() if k != "params"}
        d["param_names"] = list(names)
        pg.append(d)

    tied = {}
    if spec["tied"]:
        assert engine.module.head.weight is engine.module.emb.weight
        tied = {"head.weight": "emb.weight"}
    buffers = [n for n, _ in engine.module.named_buffers() if n in sd]

    lr_sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None

    return tensors, {
        "zero_stage": zero_stage,
        "global_steps": int(engine.global_steps),
        "global_samples": int(engine.global_samples),
        "skipped_steps": int(engine.skipped_steps),
        "helper_mismatch": helper_mismatch,
        "optimizer_class": type(base).__name__,
        "optimizer_wrapper": type(engine.optimizer).__name__,
        "state_names": state_names,
        "step": steps[0] if steps else None,
        "param_groups": pg,
        "trainable": trainable,
        "frozen": frozen,
        "tied": tied,
        "buffers": buffers,
        "lr_scheduler": _jsonable(lr_sched),
    }


def worker(name, out_dir):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm as dist
    from safetensors.torch import save_file

    sys.dont_write_bytecode = True  # keep tools/ free of __pycache__
    from fixture_model import build_model, make_batch, param_groups

    spec = CONFIGS[name]
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == spec["world"], (world, spec["world"])
    if spec.get("kind"):
        return parallel_worker(spec, out_dir, rank)

    allow_cpu_fp16(spec)

    model = build_model(tied=spec["tied"], frozen=spec["frozen"])
    groups, group_names = param_groups(model, two_groups=spec["two_groups"])
    ds_config = copy.deepcopy(spec["ds_config"])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config)

    ckpt_dir = os.path.join(out_dir, "checkpoint")
    losses, step_idx = [], 0
    overflow_steps = []
    while engine.global_steps - engine.skipped_steps < STEPS:
        assert step_idx < STEPS + 10, "too many overflow-skipped steps"
        batch = make_batch(step_idx, rank, MICRO_BATCH).to(engine.device)
        loss = engine(batch)
        engine.backward(loss)
        skipped_before = engine.skipped_steps
        engine.step()
        if engine.skipped_steps != skipped_before:
            overflow_steps.append(engine.global_steps)
        losses.append(float(loss.detach().float()))
        step_idx += 1
        if spec["save_step2"] and engine.global_steps == 2:
            engine.save_checkpoint(ckpt_dir, client_state=dict(CLIENT_STATE))

    tensors, info = engine_truth(engine, spec)

    # ---------------- save ----------------
    engine.save_checkpoint(ckpt_dir, client_state=dict(CLIENT_STATE))
    dist.barrier()

    if rank == 0:
        with open(os.path.join(ckpt_dir, "latest")) as f:
            tag = f.read().strip()
        truth = {
            "name": name,
            "world_size": world,
            "zero_stage": info["zero_stage"],
            "dtype": spec["dtype"],
            "ds_config": spec["ds_config"],
            "tag": tag,
            "global_steps": info["global_steps"],
            "global_samples": info["global_samples"],
            "skipped_steps": info["skipped_steps"],
            "overflow_steps": overflow_steps,
            **{k: info[k] for k in ("helper_mismatch", "optimizer_class", "optimizer_wrapper", "state_names",
                                    "step", "param_groups", "trainable", "frozen", "tied", "buffers",
                                    "lr_scheduler")},
            "client_state": dict(CLIENT_STATE),
            "micro_batch": MICRO_BATCH,
            "losses": losses,
            "ds_version": deepspeed.__version__,
            "torch_version": torch.__version__.split("+")[0],
        }
        save_file(tensors, os.path.join(out_dir, "truth.safetensors"), metadata={"name": name})
        with open(os.path.join(out_dir, "truth.json"), "w") as f:
            json.dump(truth, f, indent=1, sort_keys=False)
            f.write("\n")
    dist.barrier()


def parallel_worker(spec, out_dir, rank):
    """The tensor/pipeline-parallel fixtures (tools/fixture_parallel.py): train, take the truth, save."""
    import deepspeed
    import deepspeed.comm as dist
    import torch
    from safetensors.torch import save_file

    import fixture_parallel as fp

    spec = copy.deepcopy(spec)
    if spec["kind"] == "autotp":
        engine, losses = fp.autotp_worker(spec, out_dir, rank)
    elif spec["kind"] == "megatron":
        import fixture_megatron
        engine, losses = fixture_megatron.megatron_worker(spec, out_dir, rank)
    elif spec["kind"] == "megatron_pipe":
        import fixture_megatron_pipe
        engine, losses = fixture_megatron_pipe.megatron_pipe_worker(spec, out_dir, rank)
    elif spec["kind"] in ("autoep", "moe"):
        import fixture_moe
        engine, losses = fixture_moe.moe_worker(spec, out_dir, rank)
    else:
        engine, losses = fp.pipe_worker(spec, out_dir, rank)
    base = _base_optimizer(engine)
    if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    state_names, steps = [], []
    for st in base.state.values():
        for k, v in st.items():
            if k == "step":
                steps.append(_number(v))
            elif torch.is_tensor(v) and v.dim() > 0 and k not in state_names:
                state_names.append(k)
    if spec["kind"] == "autotp":
        tensors = fp.autotp_truth(engine, state_names)
    elif spec["kind"] == "megatron":
        tensors = fixture_megatron.megatron_truth(engine, engine.mpu, state_names)
    elif spec["kind"] == "megatron_pipe":
        tensors = fixture_megatron_pipe.megatron_pipe_truth(engine, state_names, _flat_truth)
    elif spec["kind"] in ("autoep", "moe"):
        tensors = fixture_moe.moe_truth(engine, state_names, _flat_truth)
        tensors["logits"] = spec["truth_extra"].pop("logits")
    else:
        tensors = fp.pipe_truth(engine, state_names, _flat_truth)
    if spec["dtype"] == "fp32":   # the module weights are the fp32 masters: must agree exactly
        for k in [k for k in tensors if k.startswith("fp32/")]:
            assert torch.equal(tensors[k], tensors["module/" + k[5:]]), f"fp32 master != module weight for {k}"
    ckpt_dir = os.path.join(out_dir, "checkpoint")
    engine.save_checkpoint(ckpt_dir, client_state=dict(CLIENT_STATE))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(ckpt_dir, "latest")) as f:
            tag = f.read().strip()
        trainable = sorted({k.split("/", 1)[1] for k in tensors if k.startswith("fp32/")})
        truth = {
            "name": spec["name"], "kind": spec["kind"], "world_size": spec["world"],
            "zero_stage": int(engine.zero_optimization_stage()), "dtype": spec["dtype"],
            "ds_config": spec["ds_config"], "tag": tag, "global_steps": int(engine.global_steps),
            "global_samples": int(engine.global_samples), "skipped_steps": int(engine.skipped_steps),
            "state_names": state_names, "step": steps[0] if steps else None,
            "optimizer_class": type(base).__name__, "optimizer_wrapper": type(engine.optimizer).__name__,
            "trainable": trainable, "tied": spec["tied"], "losses": losses,
            "client_state": dict(CLIENT_STATE), "ds_version": deepspeed.__version__, "helper_mismatch": {},
            "overflow_steps": [],
            "torch_version": torch.__version__.split("+")[0],
            **spec.get("truth_extra", {}),
        }
        if spec["kind"] == "autoep":
            import transformers
            truth["transformers_version"] = transformers.__version__
        save_file(tensors, os.path.join(out_dir, "truth.safetensors"), metadata={"name": spec["name"]})
        with open(os.path.join(out_dir, "truth.json"), "w") as f:
            json.dump(truth, f, indent=1)
            f.write("\n")
    dist.barrier()


# --------------------------------------------------------------------------------------------------------------
# launcher


def _dir_size(path):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def _check(spec, final_dir):
    """Light structural checks of the produced checkpoint; returns a list of problems."""
    problems = []
    ck = os.path.join(final_dir, "checkpoint")
    with open(os.path.join(final_dir, "truth.json")) as f:
        truth = json.load(f)
    tag = truth["tag"]
    if tag != f"global_step{STEPS}":
        problems.append(f"tag is {tag}")
    files = sorted(os.listdir(os.path.join(ck, tag)))
    optim = [f for f in files if f.endswith("optim_states.pt")]
    if len(optim) != spec["world"]:
        problems.append(f"{len(optim)} optim files")
    if not os.path.exists(os.path.join(ck, "zero_to_fp32.py")):
        problems.append("zero_to_fp32.py missing")
    if spec["save_step2"] and not os.path.isdir(os.path.join(ck, "global_step2")):
        problems.append("global_step2 missing")
    if spec["name"].startswith("bf16opt"):
        import torch
        if not all(f.startswith("bf16_zero_pp_rank_") for f in optim):
            problems.append(f"optim file names {optim}")
        sd = torch.load(os.path.join(ck, tag, optim[0]), map_location="cpu", weights_only=False)
        if "zero_stage" in sd["optimizer_state_dict"]:
            problems.append("bf16opt optim file has zero_stage")
        if truth["optimizer_wrapper"] != "BF16_Optimizer":
            problems.append(f"wrapper is {truth['optimizer_wrapper']}")
    return problems


def launch(name, out, log_dir):
    spec = CONFIGS[name]
    final_dir = os.path.join(out, name)
    tmp_dir = os.path.join(out, f".tmp-{name}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    args = ["--nnodes", "1", "--master_addr", "127.0.0.1", os.path.abspath(__file__), "--worker", name,
            "--out", tmp_dir]
    log_path = os.path.join(log_dir, f"{name}.log")
    t0 = time.time()
    with open(log_path, "w") as log:
        try:
            proc = torchrun_jobs.launch(spec["world"], args, {**os.environ, **RANK_ENV}, timeout=LAUNCH_TIMEOUT,
                                        cwd=REPO)
            log.write(proc.stdout + proc.stderr)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    dt = time.time() - t0
    if rc != 0 or not os.path.exists(os.path.join(tmp_dir, "truth.json")):
        with open(log_path, errors="replace") as f:
            lines = f.read().splitlines()
        errors = [ln for ln in lines if ("Error" in ln or "Exception" in ln) and "ChildFailedError" not in ln]
        shown = list(dict.fromkeys(errors))[-6:] or lines[-15:]
        print(f"FAIL {name}: rc={rc} ({dt:.1f}s), log {log_path}\n    " + "\n    ".join(shown), flush=True)
        shutil.rmtree(tmp_dir, ignore_errors=True)
        return False
    shutil.rmtree(final_dir, ignore_errors=True)
    os.rename(tmp_dir, final_dir)
    problems = _check(spec, final_dir)
    with open(os.path.join(final_dir, "truth.json")) as f:
        truth = json.load(f)
    nfiles = sum(len(fs) for _, _, fs in os.walk(final_dir))
    extra = f" overflow-skipped={truth['overflow_steps']}" if truth["skipped_steps"] else ""
    if truth["helper_mismatch"]:
        extra += (f" [safe_get_full_* disagree on {len(truth['helper_mismatch'])} tensors, max "
                  f"{max(truth['helper_mismatch'].values()):.3g}; truth taken from flat buffers]")
    print(f"{'ok  ' if not problems else 'BAD '} {name:26s} zero={truth['zero_stage']} {truth['dtype']:4s} "
          f"dp={truth['world_size']} tag={truth['tag']} opt={truth['optimizer_wrapper']}/{truth['optimizer_class']} "
          f"state={','.join(truth['state_names'])} step={truth['step']} files={nfiles} "
          f"size={_dir_size(final_dir) / 1024:.0f}K time={dt:.1f}s loss={truth['losses'][-1]:.4f}{extra}"
          + (f" PROBLEMS: {problems}" if problems else ""),
          flush=True)
    return not problems


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help="comma-separated fixture names (default: all)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output directory (default: fixtures/)")
    ap.add_argument("--jobs", type=int, default=2, help="concurrent torchrun launches (default 2)")
    ap.add_argument("--list", action="store_true", help="list the configuration names and exit")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # also for the parent (checks unpickle DeepSpeed classes)
    if args.worker:
        torchrun_jobs.run_rank(worker, args.worker, args.out)     # exits
    if args.list:
        print("\n".join(CONFIGS))
        return 0

    names = list(CONFIGS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown fixture(s) {unknown}; known: {', '.join(CONFIGS)}")
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    log_dir = tempfile.mkdtemp(prefix="reshard-fixture-logs-")

    t0 = time.time()
    torchrun_jobs.build_deepspeed_ops({**os.environ, **RANK_ENV}, log=print)    # once: the ranks only load it
    if args.jobs > 1:
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as ex:
            results = list(ex.map(lambda n: launch(n, out, log_dir), names))
    else:
        results = [launch(n, out, log_dir) for n in names]
    failed = [n for n, ok in zip(names, results, strict=True) if not ok]
    print(f"{len(names) - len(failed)}/{len(names)} fixtures ok in {time.time() - t0:.0f}s; "
          f"{out}: {_dir_size(out) / 1024:.0f}K" + (f"; FAILED: {','.join(failed)}" if failed else ""))
    if not failed:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
