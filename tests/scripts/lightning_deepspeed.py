"""Lightning's DeepSpeedStrategy on CPU under torchrun: save a ZeRO checkpoint with ModelCheckpoint, or resume one
with `trainer.fit(model, ckpt_path=...)` and compare the live engine with the truth taken at save time.

    torchrun --nproc_per_node N tests/scripts/lightning_deepspeed.py JOBS.json RESULTS.json

JOBS.json is a list of jobs, run in order in one process (one engine start per job):
  {"mode": "save", "dir": D, "seed": S, "truth": T, "stage": Z, "steps": K}: fit K steps from seed S; the
      ModelCheckpoint in D saves `D/step=K.ckpt/` at step K; rank 0 writes the live engine's full fp32 params,
      both Adam moments and the module weights to T (safetensors) and what Lightning saved to T + ".json".
  {"mode": "resume", "ckpt": C, "dir": D, "truth": T, "control": T2, "stage": Z, "steps": K}: fit from C
      (another seed: everything must come from the checkpoint) up to step K + 1; right after the restore
      (on_train_start) the engine is compared with T, and with another run's truth T2 (which must differ), and
      the trainer's step, epoch, lr scheduler and ModelCheckpoint state are recorded; then one more step runs.
  {"mode": "fail", "ckpt": C, ...as resume}: the same fit; the error it ends with is recorded.

Lightning refuses DeepSpeed off CUDA (`setup_environment` asserts a CUDAAccelerator) and gives CPU devices no
index, which DeepSpeed needs as its device rank: `cpu_strategy` lifts only that, with the CPU accelerator and the
indexed CPU devices `cpu:LOCAL_RANK`; everything else is Lightning's and DeepSpeed's own code. The ranks cannot
import reshard (pickles.block_reshard), as on a machine where it is not installed.
"""
import json
import math
import os

from tests.helpers.engine_state import differences, engine_tensors
from tests.helpers.pickles import block_reshard
from tests.helpers.rank_main import run_main

block_reshard()     # the training job runs where reshard is not installed: what it loads must not need it

SAMPLES, BATCH = 64, 2          # enough batches that no size ends the epoch within these steps
LR, STEP_SIZE, GAMMA = 1e-2, 2, 0.5
SCHEDULER_KEYS = ("last_epoch", "_step_count", "_last_lr", "base_lrs", "step_size", "gamma")


def lit_module(note):
    import lightning.pytorch as pl
    import torch

    from tests.helpers import single_models as sm

    class LitLogged(pl.LightningModule):
        """The TinyLM trained with AdamW and a per-step StepLR; logs its loss for ModelCheckpoint to monitor
        (so the callback's state holds tensors: best_model_score, best_k_models, kth_value)."""

        def __init__(self, note):
            super().__init__()
            self.save_hyperparameters()     # Lightning's client state gets `hyper_parameters`
            self.net = sm.TinyLM()

        def training_step(self, batch, batch_idx):
            loss = self.net(batch)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=STEP_SIZE, gamma=GAMMA)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return LitLogged(note)


def cpu_strategy(stage):
    """Lightning's DeepSpeedStrategy with its CUDA-only check lifted (see the module docstring)."""
    import lightning.pytorch.strategies.deepspeed as lightning_deepspeed
    import torch
    from lightning.pytorch.accelerators import CPUAccelerator
    lightning_deepspeed.CUDAAccelerator = CPUAccelerator     # the one isinstance check in setup_environment
    devices = [torch.device("cpu", i) for i in range(int(os.environ["LOCAL_WORLD_SIZE"]))]
    return lightning_deepspeed.DeepSpeedStrategy(stage=stage, parallel_devices=devices)


def main(jobs_path, results_path):
    import torch
    torch.set_num_threads(1)
    with open(jobs_path) as f:
        jobs = json.load(f)
    results = [RUN[job["mode"]](job) for job in jobs]
    import torch.distributed as dist
    if dist.get_rank() == 0:
        with open(results_path, "w") as f:
            json.dump(results, f)
    dist.barrier()


def trainer_for(job, callbacks, max_steps):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    checkpoint = ModelCheckpoint(dirpath=job["dir"], filename="{step}", monitor="train_loss", save_top_k=2,
                                 every_n_train_steps=job["steps"])
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                         strategy=cpu_strategy(job["stage"]), logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[checkpoint, *callbacks])
    return trainer, checkpoint


def data():
    import torch

    from tests.helpers import single_models as sm
    return torch.utils.data.DataLoader([sm.tokens(i, batch=1)[0] for i in range(SAMPLES)], batch_size=BATCH)


def engine_state(trainer, module) -> dict:
    return engine_tensors(trainer.strategy.deepspeed_engine, module)


def plain(value):
    """A callback's state as JSON: each tensor as {"tensor": value}, any other object as {"type": its class}."""
    import torch
    if torch.is_tensor(value):
        return {"tensor": float(value)}
    if isinstance(value, dict):
        return {k: plain(x) for k, x in value.items()}
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    return {"type": f"{type(value).__module__}.{type(value).__name__}"}


def save(job):
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    class Truth(pl.Callback):
        def on_save_checkpoint(self, trainer, module, saved):     # what Lightning hands DeepSpeed as client state
            self.saved = {"global_step": saved["global_step"], "epoch": saved["epoch"],
                          "scheduler": {k: saved["lr_schedulers"][0][k] for k in SCHEDULER_KEYS},
                          "model_checkpoint": plain(saved["callbacks"][self.checkpoint.state_key])}

        def on_train_end(self, trainer, module):      # the step that saved was the last one
            self.state = engine_state(trainer, module)

    torch.manual_seed(job["seed"])
    module, truth = lit_module(note=f"seed {job['seed']}"), Truth()
    trainer, checkpoint = trainer_for(job, [truth], job["steps"])
    truth.checkpoint = checkpoint
    trainer.fit(module, data())
    ckpt = os.path.join(job["dir"], f"step={job['steps']}.ckpt")
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in truth.state.items()}, job["truth"])
        with open(job["truth"] + ".json", "w") as f:
            json.dump({"ckpt": ckpt, **truth.saved, "lr": trainer.optimizers[0].param_groups[0]["lr"]}, f)
    dist.barrier()
    return {"mode": "save", "ckpt": ckpt}


def scheduler_state(scheduler) -> dict:
    state = scheduler.state_dict()
    return {k: state[k] for k in SCHEDULER_KEYS}


def resume(job):
    import lightning.pytorch as pl
    import torch
    from safetensors.torch import load_file

    truth, control = load_file(job["truth"]), load_file(job["control"])
    seen = {}

    class Check(pl.Callback):
        def on_train_start(self, trainer, module):     # after Lightning restored the checkpoint, before a step
            state = engine_state(trainer, module)
            seen.update(problems=differences(state, truth), control_problems=differences(state, control),
                        compared=len(truth), global_step=trainer.global_step, epoch=trainer.current_epoch,
                        scheduler=scheduler_state(trainer.lr_scheduler_configs[0].scheduler),
                        lr=trainer.optimizers[0].param_groups[0]["lr"],
                        model_checkpoint=plain(checkpoint.state_dict()))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            seen.update(after_step=trainer.global_step, loss=float(loss),
                        scheduler_after=scheduler_state(trainer.lr_scheduler_configs[0].scheduler),
                        lr_after=trainer.optimizers[0].param_groups[0]["lr"])

    torch.manual_seed(4321)
    module = lit_module(note="another init")
    trainer, checkpoint = trainer_for(job, [Check()], job["steps"] + 1)
    trainer.fit(module, data(), ckpt_path=job["ckpt"])
    if not math.isfinite(seen.get("loss", math.nan)):
        seen.setdefault("problems", []).append(f"one more step: loss {seen.get('loss')}")
    return {"mode": "resume", "ckpt": job["ckpt"], "world": int(os.environ["WORLD_SIZE"]), **seen}


def fail(job):
    """The resume of a checkpoint the engine cannot take at this size: the error it raises."""
    try:
        resume({**job, "control": job["truth"]})
    except Exception as e:      # what the user would see; the trainer has torn down
        return {"mode": "fail", "ckpt": job["ckpt"], "error": f"{type(e).__name__}: {e}"}
    return {"mode": "fail", "ckpt": job["ckpt"], "error": None}


RUN = {"save": save, "resume": resume, "fail": fail}

if __name__ == "__main__":
    run_main(main, 2)
