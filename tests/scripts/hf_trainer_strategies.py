"""A transformers.Trainer run of the tiny Llama of tests/scripts/hf_trainer_fsdp.py under DeepSpeed ZeRO or FSDP
(torchrun, CPU, gloo): save, or resume from a checkpoint-N/ (the other strategy's, converted by reshard).

    torchrun --nproc_per_node W tests/scripts/hf_trainer_strategies.py JOBS.json RESULTS.json

JOBS.json lists jobs run in order in one process, each {"mode": "save" | "resume" | "weights", "strategy": "deepspeed" |
"fsdp", "stage": S (deepspeed), "out": dir, "max_steps": N, "save_steps": K, "truth": file, "checkpoint": dir
(resume), "negative": file (resume), "scheduler": the source's scheduler.pt (resume), "fails": true where the run
must end in an error (its result)}. The Trainer's arguments are tests/scripts/hf_trainer_fsdp.py's (lr 1e-2, linear
schedule, 2 samples per process, the same 16 samples), so a save of either strategy resumes under the other.
save (deepspeed): at the save every rank takes the live engine's truth (engine_state.engine_tensors: fp32 params,
      both Adam moments) and rank 0 writes it to `truth`.
resume: the model starts from another seed; right after the load (on_train_begin) the full state is gathered (FSDP:
      torch's get_model_state_dict / get_optimizer_state_dict, full; DeepSpeed: engine_tensors) and compared with
      `truth` ({"fp32/<name>", "exp_avg/<name>", "exp_avg_sq/<name>"}) bit for bit, and with `negative`, which
      must differ; every parameter's optimizer step, the global step and the scheduler's state_dict (against
      torch.load of `scheduler`) are reported; then one more step runs.
weights: a resume from a weights-only folder (FSDP's less optimizer_0/, which the Trainer loads as the model alone:
      no optimizer, no scheduler), compared the same way on the truth's "fp32/" tensors only.
Rank 0 writes each job with its {"problems": [...], ...} to RESULTS.json.
"""
import os

from tests.helpers.cpu_fsdp import fsdp_on_cpu
from tests.helpers.engine_state import differences, engine_tensors
from tests.helpers.rank_main import run_main
from tests.scripts.hf_trainer_deepspeed import cpu_deepspeed_backend, release, run_jobs

STATES = ("exp_avg", "exp_avg_sq")


def main(jobs_path, results_path):
    run_jobs(jobs_path, results_path, run)


def fsdp_tensors(trainer) -> tuple:
    """({"fp32/<name>", "exp_avg/<name>", "exp_avg_sq/<name>"}, {name: step}) of an FSDP-wrapped Trainer model, full
    (collectives: every rank calls it; offloaded to the CPU, rank 0 alone gets them)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(trainer.model_wrapped, options=options)
    optim = get_optimizer_state_dict(trainer.model_wrapped, trainer.optimizer.optimizer, options=options)
    out = {f"fp32/{name}": value.detach().clone().contiguous() for name, value in model.items()}
    for name, states in optim.get("state", {}).items():
        out.update({f"{state}/{name}": states[state].detach().clone().contiguous() for state in STATES})
    return out, {name: float(states["step"]) for name, states in optim.get("state", {}).items()}


def deepspeed_steps(engine) -> dict:
    """{flat group index: step} of the ZeRO optimizer's torch optimizer (ZeRO-1/2 count per flat group)."""
    state = engine.optimizer.optimizer.state
    return {str(i): float(s["step"]) for i, s in enumerate(state.values()) if "step" in s}


def run(job) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    torch.set_num_threads(1)
    for name in [n for n in os.environ if n == "ACCELERATE_USE_FSDP" or n.startswith("FSDP_")]:
        del os.environ[name]            # what TrainingArguments exported for an FSDP job before
    fsdp = job["strategy"] == "fsdp"
    problems, report = [], {}

    class Probe(TrainerCallback):
        trainer = None

        def gathered(self) -> tuple:
            if fsdp:
                return fsdp_tensors(self.trainer)
            return engine_tensors(self.trainer.model_wrapped), deepspeed_steps(self.trainer.model_wrapped)

        def on_save(self, args, state, control, **kwargs):
            if job["mode"] != "save":
                return
            tensors, _ = self.gathered()
            if dist.get_rank() == 0:
                from safetensors.torch import save_file
                save_file({k: v for k, v in tensors.items() if not k.startswith("module/")}, job["truth"])
                report["saved_global_step"] = state.global_step

        def on_train_begin(self, args, state, control, **kwargs):
            if job["mode"] == "save":
                return
            tensors, steps = self.gathered()
            if dist.get_rank() != 0:
                return
            from safetensors.torch import load_file
            weights = job["mode"] == "weights"      # (the optimizer and the scheduler start afresh)

            def wanted(path):
                return {k: v for k, v in load_file(path).items() if not weights or k.startswith("fp32/")}
            truth = wanted(job["truth"])
            problems.extend(differences(tensors, truth))
            saved = None if weights else torch.load(job["scheduler"], weights_only=True)
            if saved is not None and self.trainer.lr_scheduler.state_dict() != saved:
                problems.append(f"scheduler {self.trainer.lr_scheduler.state_dict()} != saved {saved}")
            report.update(resumed_global_step=state.global_step, compared=len(truth), steps=sorted(set(steps.values())),
                          negative_differences=len(differences(tensors, wanted(job["negative"]))))

        def on_step_end(self, args, state, control, **kwargs):
            if job["mode"] != "save":
                report.update(next_global_step=state.global_step)
                control.should_training_stop = True      # one more step is all a resume must show

    if fsdp:
        fsdp_on_cpu()
    else:
        cpu_deepspeed_backend()
    torch.manual_seed(0 if job["mode"] == "save" else 1234)     # resume: everything must come from the checkpoint
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    tokens = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    strategy = {"fsdp": True, "use_cpu": True,
                "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT",
                                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}} if fsdp else {
        "ddp_backend": "gloo",
        "deepspeed": {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                      "gradient_clipping": "auto", "zero_optimization": {"stage": job.get("stage", 2)},
                      "steps_per_print": 10**9}}
    args = TrainingArguments(output_dir=job["out"], max_steps=job["max_steps"], save_steps=job["save_steps"],
                             per_device_train_batch_size=2, learning_rate=1e-2, report_to=[], logging_steps=1,
                             disable_tqdm=True, seed=0, **strategy)
    probe = Probe()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[probe])
    probe.trainer = trainer
    report["world_size"] = args.world_size
    report["distributed_type"] = str(trainer.accelerator.distributed_type)
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        output = trainer.train(resume_from_checkpoint=job.get("checkpoint"))
    except CheckpointException as error:    # a BaseException: run_jobs takes a job's failure as an Exception
        lines = str(error).splitlines()      # each rank's traceback: the first rank's error line says why
        raise RuntimeError("CheckpointException: " + next((line for line in lines if "Error:" in line), lines[0])) \
            from None
    if job["mode"] != "save":     # (the loss of the one step: its log follows the source's logging_steps)
        report["next_loss"] = output.training_loss
        if not torch.isfinite(torch.tensor(output.training_loss)):
            problems.append(f"one more step: loss {output.training_loss}")
    if fsdp:
        dist.barrier()
    else:
        release(trainer.model_wrapped)
    return {"problems": problems, **report}


if __name__ == "__main__":
    run_main(main, 2)
