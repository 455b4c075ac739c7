"""A transformers.Trainer run with DeepSpeed (torchrun, CPU, gloo): save, or resume from a checkpoint-N/.

    torchrun --nproc_per_node W tests/scripts/hf_trainer_deepspeed.py JOBS.json RESULTS.json

JOBS.json lists jobs, run in order in one process (Accelerate's and transformers' DeepSpeed state reset between
them), each {"mode": "save" | "resume", "out": dir, "stage": S, "max_steps": N, "save_steps": K,
             "checkpoint": checkpoint-K dir (resume), "truth": file, "negative": file (resume),
             "gradient_accumulation_steps": G, "fails": true where the run must end in an error (its result)}.
save: trains a tiny random GPT-2 (from a config) to max_steps, saving every save_steps; at each save every
      rank takes the live engine's truth (full fp32 params, both Adam moments, module weights, gathered under ZeRO-3)
      and rank 0 writes it to `truth` formatted with step=the global step.
resume: the same Trainer (same max_steps, so the same lr schedule), trainer.train(resume_from_checkpoint=...);
      right after the load (on_train_begin) the engine's tensors are compared with `truth` bit for bit (and
      with `negative`, another state's truth, which must differ), the global step and epoch reported; then one more step
      runs (training stops after it) and its global step and lr are reported, for the test to compare with the source
      run's log at that step.
Rank 0 writes each job with its {"problems": [...], ...} to RESULTS.json.
"""
import json
import math

from tests.helpers.engine_state import differences, engine_tensors
from tests.helpers.rank_main import run_main

SAMPLES = 48        # one epoch holds every step of the runs the tests make


def cpu_deepspeed_backend() -> None:
    """Accelerate picks a process-group backend only for accelerator devices (or for cpu=True, which turns
    DeepSpeed off): on CPU under torchrun it finds none and runs one process. Give it gloo on CPU (what
    DS_ACCELERATOR=cpu trains on); nothing else of Accelerate or the Trainer is changed."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    chosen = PartialState._prepare_backend

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        backend, kind = chosen(self, cpu, sagemaker_dp, backend)
        return ("gloo", DistributedType.MULTI_CPU) if backend is None else (backend, kind)
    PartialState._prepare_backend = prepare_backend


def main(jobs_path, results_path):
    run_jobs(jobs_path, results_path, run)


def run_jobs(jobs_path, results_path, run_one, first=None) -> None:
    """`run_one(job)` for each job, each in a fresh Accelerate and transformers DeepSpeed state; rank 0 writes
    the results, in the jobs' order. A job with "fails" must raise: its error is its result. `first(job)`: true
    for the jobs run before the others (whichever test module gave them)."""
    import gc

    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    with open(jobs_path) as f:
        jobs = json.load(f)
    results: list = [None] * len(jobs)
    for index in sorted(range(len(jobs)), key=lambda i: first is None or not first(jobs[i])):
        job = jobs[index]
        try:
            results[index] = {**job, **run_one(job)}
        except Exception as error:      # DeepSpeed's refusal, raised on every rank as it loads: no rank waits
            if not job.get("fails"):
                raise
            results[index] = {**job, "error": f"{type(error).__name__}: {error}"}
            gc.collect()
        AcceleratorState._reset_state(reset_partial_state=False)    # the next job's plugin is its own
        GradientState._reset_state()
        unset_hf_deepspeed_config()
    if dist.get_rank() == 0:
        with open(results_path, "w") as f:
            json.dump(results, f)
    dist.barrier()


def run(job) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from tests.helpers import single_models
    torch.set_num_threads(1)
    cpu_deepspeed_backend()
    problems, report = [], {}
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "gradient_clipping": "auto",
                 "zero_optimization": {"stage": job["stage"]}, "steps_per_print": 10**9}

    class Probe(TrainerCallback):
        """Takes the truth at the first save (save mode) or compares with it right after the load (resume)."""
        trainer = None
        saved = False

        def on_save(self, args, state, control, **kwargs):
            if job["mode"] != "save":
                return
            tensors = engine_tensors(self.trainer.model_wrapped)
            if dist.get_rank() == 0:
                from safetensors.torch import save_file
                save_file(tensors, job["truth"].format(step=state.global_step))
                report.setdefault("saves", []).append({"global_step": state.global_step, "epoch": state.epoch})

        def on_train_begin(self, args, state, control, **kwargs):
            if job["mode"] != "resume":
                return
            tensors = engine_tensors(self.trainer.model_wrapped)
            if dist.get_rank() != 0:
                return
            from safetensors.torch import load_file
            truth = load_file(job["truth"])
            problems.extend(differences(tensors, truth))
            # the negative control: another state's truth must not compare equal
            report.update(resumed_global_step=state.global_step, resumed_epoch=state.epoch, compared=len(truth),
                          negative_differences=len(differences(tensors, load_file(job["negative"]))))

        def on_step_end(self, args, state, control, **kwargs):
            if job["mode"] == "resume":
                report.update(next_global_step=state.global_step,
                              next_lr=self.trainer.lr_scheduler.get_last_lr()[0])
                control.should_training_stop = True      # one more step is all a resume must show

        def on_log(self, args, state, control, logs=None, **kwargs):
            if job["mode"] == "resume" and logs and "loss" in logs:
                report.update(next_loss=logs["loss"], next_logged_lr=logs.get("learning_rate"),
                              next_logged_step=state.global_step, next_epoch=logs.get("epoch"))

    torch.manual_seed(1234 if job["mode"] == "resume" else 0)   # resume: everything must come from the checkpoint
    model = GPT2LMHeadModel(single_models.gpt2_config())
    data = [{"input_ids": t, "labels": t} for t in (single_models.tokens(i, batch=1)[0] for i in range(SAMPLES))]
    args = TrainingArguments(output_dir=job["out"], max_steps=job["max_steps"], save_steps=job["save_steps"],
                             per_device_train_batch_size=2,
                             gradient_accumulation_steps=job.get("gradient_accumulation_steps", 1),
                             learning_rate=1e-2, weight_decay=0.01, warmup_steps=2, lr_scheduler_type="linear",
                             report_to=[], logging_steps=1, disable_tqdm=True, seed=0, deepspeed=ds_config,
                             ddp_backend="gloo")
    probe = Probe()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[probe],
                      processing_class=single_models.tiny_tokenizer())     # saved in every checkpoint
    probe.trainer = trainer
    resume = job.get("checkpoint")
    report["world_size"] = args.world_size
    trainer.train(resume_from_checkpoint=resume)
    if job["mode"] == "resume" and not math.isfinite(report.get("next_loss", float("nan"))):
        problems.append(f"one more step: loss {report.get('next_loss')}")
    release(trainer.model_wrapped)
    return {"problems": problems, **report}


def release(engine) -> None:
    """Release the engine once every rank is done with it."""
    import gc

    import torch.distributed as dist
    dist.barrier()
    if hasattr(engine, "destroy"):
        engine.destroy()
    gc.collect()


if __name__ == "__main__":
    run_main(main, 2)
