"""Lightning's FSDPStrategy (state_dict_type="sharded") on CPU under torchrun: save with ModelCheckpoint, or resume
with `trainer.fit(model, ckpt_path=...)` and compare the live model and optimizer with a truth read from the source
checkpoint by torch alone (the test's dcp_to_torch_save and torch.load).

    torchrun --nproc_per_node N tests/scripts/lightning_fsdp.py JOBS.json RESULTS.json

JOBS.json is a list of jobs, run in order in one process:
  {"mode": "save", "dir": D, "seed": S, "steps": K[, "state_dict_type": "full"][, "strategy": "model_parallel"]}:
      fit K steps from seed S; ModelCheckpoint saves `D/step=K.ckpt/` (with "full": one file, `D/step=K.ckpt`);
      every job may name ModelParallelStrategy instead of FSDPStrategy.
  {"mode": "resume", "ckpt": C, "dir": D, "truth": T, "control": T2, "steps": K}: fit from C (another seed:
      everything must come from the checkpoint) up to step K + 1; right after the restore (on_train_start) the
      gathered model weights, both Adam moments and each param's step are compared with T (a torch.save of
      {"tensors": {...}, "global_step", "scheduler"}) and with another run's T2 (which must differ), the trainer's
      step, epoch and lr scheduler recorded; then one more step runs.
  {"mode": "fail", ...as resume}: the same fit; the error it ends with is recorded (None: it resumed).
  {"mode": "weights", "ckpt": C, "truth": T, "control": T2}: `trainer.validate(model, ckpt_path=C)` (the strategy's
      load without the optimizer: a weights-only checkpoint's); at on_validation_start the gathered model weights
      are compared with T's "model/" tensors and with T2's (which must differ); "problems", "control_problems".

The CPU shim is tests/helpers/cpu_fsdp.py's; the model, data and scheduler are tests/scripts/lightning_deepspeed.py's.
The ranks cannot import reshard (pickles.block_reshard).
"""
import math
import os

from tests.helpers.engine_state import differences
from tests.helpers.rank_main import run_main
from tests.scripts.lightning_deepspeed import data, lit_module, scheduler_state

STATES = ("exp_avg", "exp_avg_sq", "step")
MODEL_PARALLEL = "model_parallel"


def strategy(job):
    """FSDPStrategy through the CPU shim, or ModelParallelStrategy (FSDP2: runs on CPU with gloo as it is)."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from tests.helpers.cpu_fsdp import lightning_fsdp_on_cpu
    if job.get("strategy") == MODEL_PARALLEL:
        return ModelParallelStrategy(data_parallel_size=int(os.environ["WORLD_SIZE"]), tensor_parallel_size=1)
    return lightning_fsdp_on_cpu(FSDPStrategy)(state_dict_type=job.get("state_dict_type", "sharded"),
                                               process_group_backend="gloo")


def module_for(job, note):
    """tests/scripts/lightning_deepspeed.py's module; under ModelParallelStrategy with FSDP2's fully_shard applied in
    configure_model, as that strategy requires. Built from the seed's RNG state as it is when called."""
    import torch
    state = torch.get_rng_state()
    plain = type(lit_module(note))
    torch.set_rng_state(state)
    if job.get("strategy") != MODEL_PARALLEL:
        return plain(note)

    class Sharded(plain):
        def configure_model(self):
            from torch.distributed.fsdp import fully_shard
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])
    return Sharded(note)


def trainer_for(job, callbacks, max_steps):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    checkpoint = ModelCheckpoint(dirpath=job["dir"], filename="{step}", every_n_train_steps=job["steps"],
                                 save_top_k=-1)
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                      strategy=strategy(job), logger=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[checkpoint, *callbacks])


def save(job):
    import torch
    torch.manual_seed(job["seed"])
    trainer = trainer_for(job, [], job["steps"])
    trainer.fit(module_for(job, note=f"seed {job['seed']}"), data())
    return {"mode": "save", "ckpt": os.path.join(job["dir"], f"step={job['steps']}.ckpt")}


def live_state(trainer) -> dict:
    """The whole model and optimizer as FSDP gathers them (every rank holds them): {"model/<fqn>",
    "<state>/<fqn>"}; cpu_offload off, since the CPU is already FSDP's device here."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    model, optim = get_state_dict(trainer.strategy.model, trainer.optimizers[0],
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    out = {f"model/{k}": v.detach().clone() for k, v in model.items()}
    for fqn, states in optim["state"].items():
        out.update({f"{s}/{fqn}": states[s].detach().clone() for s in STATES if s in states})
    return out



def resume(job):
    import lightning.pytorch as pl
    import torch
    truth, control = torch.load(job["truth"]), torch.load(job["control"])
    seen = {}

    class Check(pl.Callback):
        def on_train_start(self, trainer, module):     # after Lightning restored the checkpoint, before a step
            state = live_state(trainer)
            seen.update(problems=differences(state, truth["tensors"]),
                        control_problems=differences(state, control["tensors"]), compared=len(truth["tensors"]),
                        global_step=trainer.global_step, epoch=trainer.current_epoch,
                        scheduler=scheduler_state(trainer.lr_scheduler_configs[0].scheduler),
                        lr=trainer.optimizers[0].param_groups[0]["lr"])

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            seen.update(after_step=trainer.global_step, loss=float(loss),
                        scheduler_after=scheduler_state(trainer.lr_scheduler_configs[0].scheduler))

    torch.manual_seed(4321)
    trainer = trainer_for(job, [Check()], job["steps"] + 1)
    trainer.fit(module_for(job, note="another init"), data(), ckpt_path=job["ckpt"])
    if not math.isfinite(seen.get("loss", math.nan)):
        seen.setdefault("problems", []).append(f"one more step: loss {seen.get('loss')}")
    return {"mode": "resume", "ckpt": job["ckpt"], "world": int(os.environ["WORLD_SIZE"]), **seen}


def weights(job):
    """The strategy's load of a checkpoint's model alone (trainer.validate), compared with a truth's weights."""
    import lightning.pytorch as pl
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    truth, control = torch.load(job["truth"]), torch.load(job["control"])
    seen = {}

    class Check(pl.Callback):
        def on_validation_start(self, trainer, module):       # after the strategy loaded the checkpoint
            model = get_model_state_dict(trainer.strategy.model,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=False))
            state = {f"model/{k}": v.detach().clone() for k, v in model.items()}
            wanted = {k: v for k, v in truth["tensors"].items() if k.startswith("model/")}
            seen.update(problems=differences(state, wanted), compared=len(wanted),
                        control_problems=differences(state, {k: v for k, v in control["tensors"].items()
                                                             if k.startswith("model/")}))

    torch.manual_seed(4321)
    plain = type(module_for(job, note="another init"))

    class Validated(plain):
        def validation_step(self, batch, batch_idx):
            return self.training_step(batch, batch_idx)

    trainer = trainer_for({**job, "dir": os.path.dirname(job["ckpt"]), "steps": 1}, [Check()], 1)
    trainer.validate(Validated("another init"), data(), ckpt_path=job["ckpt"])
    return {"mode": "weights", "ckpt": job["ckpt"], **seen}


def fail(job):
    """The resume of a checkpoint Lightning cannot take here: the error it raises (None: it resumed)."""
    try:
        got = resume(job)
    except Exception as e:      # what the user would see
        return {"mode": "fail", "ckpt": job["ckpt"], "error": f"{type(e).__name__}: {e}"}
    return {"mode": "fail", "ckpt": job["ckpt"], "error": None, "resumed": got}


RUN = {"save": save, "resume": resume, "fail": fail, "weights": weights}


def main(jobs_path, results_path):
    import json

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    with open(jobs_path) as f:
        jobs = json.load(f)
    results = [RUN[job["mode"]](job) for job in jobs]
    if dist.get_rank() == 0:
        with open(results_path, "w") as f:
            json.dump(results, f)
    dist.barrier()


if __name__ == "__main__":
    run_main(main, 2)
