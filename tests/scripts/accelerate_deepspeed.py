"""An Accelerate training loop with a DeepSpeed plugin (torchrun, CPU, gloo): save_state, or load_state.

    torchrun --nproc_per_node W tests/scripts/accelerate_deepspeed.py JOBS.json RESULTS.json

JOBS.json lists jobs, run in order in one process (Accelerate's state reset between them), each
            {"mode": "save" | "load", "dir": the save_state folder, "stage": S, "steps": N, "truth": file,
             "after": file (the truth one step later), "gradient_accumulation_steps": G,
             "fails": true where the run must end in an error (its result)}.
save: a tiny random GPT-2 (from a config), torch AdamW and a linear-warmup LR scheduler, prepared with a
      DeepSpeed ZeRO-S plugin, trains N steps and calls accelerator.save_state(dir) (with a registered custom
      object); every rank takes the live engine's truth (engine_state.engine_tensors), then trains one
      more step and takes the truth again (`after`, the negative control) with the lr that step used.
load: the same objects built from another seed, accelerator.load_state(dir); the engine's tensors are compared
      with `truth` bit for bit and with `after` (must differ); the engine's global steps, the scheduler's step
      and the custom object reported; one more step runs and its lr is reported. With "module_only" (a folder
      `reshard thin` left) Accelerate's weights-only load, load_state(dir, load_module_only=True,
      load_optimizer_states=False, load_lr_scheduler_states=False), and the module's weights alone compared.
Rank 0 writes each job with its {"problems": [...], ...} to RESULTS.json.
"""
import math

from tests.helpers.rank_main import run_main

SAMPLES = 48


class Counter:
    """A custom object registered for checkpointing (custom_checkpoint_0.pkl)."""

    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def main(jobs_path, results_path):
    from tests.scripts.hf_trainer_deepspeed import run_jobs
    run_jobs(jobs_path, results_path, run)


def run(job) -> dict:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from safetensors.torch import load_file, save_file
    from transformers import GPT2LMHeadModel, get_linear_schedule_with_warmup

    from tests.helpers import single_models
    from tests.helpers.engine_state import differences, engine_tensors
    from tests.scripts.hf_trainer_deepspeed import cpu_deepspeed_backend, release
    torch.set_num_threads(1)
    cpu_deepspeed_backend()
    gas = job.get("gradient_accumulation_steps", 1)
    plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
                                           "gradient_clipping": 1.0, "steps_per_print": 10**9,
                                           "zero_optimization": {"stage": job["stage"]}})
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=gas)
    torch.manual_seed(0 if job["mode"] == "save" else 1234)   # load: everything must come from the checkpoint
    model = GPT2LMHeadModel(single_models.gpt2_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=10)
    data = [t for t in (single_models.tokens(i, batch=1)[0] for i in range(SAMPLES))]
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)
    engine, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    problems, report = [], {"world_size": accelerator.num_processes}
    batches = iter(loader)

    def train_step():
        for _ in range(gas):
            with accelerator.accumulate(engine):
                batch = next(batches)
                loss = engine(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        return float(loss)

    if job["mode"] == "save":
        for _ in range(job["steps"]):
            train_step()
            counter.count += 1
        accelerator.save_state(job["dir"])
        truth = engine_tensors(engine)
        report.update(global_steps=engine.global_steps, lr=scheduler.get_last_lr()[0])
        train_step()
        after = engine_tensors(engine)
        report["next_lr"] = scheduler.get_last_lr()[0]
        if accelerator.is_main_process:
            save_file(truth, job["truth"])
            save_file(after, job["after"])
    else:
        module_only = job.get("module_only", False)
        if module_only:
            accelerator.load_state(job["dir"], load_module_only=True, load_optimizer_states=False,
                                   load_lr_scheduler_states=False)
        else:
            accelerator.load_state(job["dir"])
        tensors = engine_tensors(engine, optimizer=not module_only)
        if accelerator.is_main_process:
            truth, after = ({k: v for k, v in load_file(job[f]).items() if not module_only or k.startswith("module/")}
                            for f in ("truth", "after"))
            problems.extend(differences(tensors, truth))
            report.update(compared=len(tensors), negative_differences=len(differences(tensors, after)))
        report.update(global_steps=engine.global_steps, lr=scheduler.get_last_lr()[0], counter=counter.count)
        loss = train_step()
        if not math.isfinite(loss):
            problems.append(f"one more step: loss {loss}")
        report.update(next_global_steps=engine.global_steps, next_lr=scheduler.get_last_lr()[0])
    release(engine)
    return {"problems": problems, **report}


if __name__ == "__main__":
    run_main(main, 2)
