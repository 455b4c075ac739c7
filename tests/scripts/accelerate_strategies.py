"""An Accelerate training loop of the tiny Llama of tests/scripts/hf_trainer_fsdp.py under DeepSpeed ZeRO-2 or FSDP2
(torchrun, CPU, gloo; FSDP through the test-only shim tests/helpers/cpu_fsdp.py): save_state, or load_state of a folder
(the other strategy's, converted by reshard).

    torchrun --nproc_per_node W tests/scripts/accelerate_strategies.py JOBS.json RESULTS.json

JOBS.json lists jobs run in one process (Accelerate's state reset between them; the FSDP jobs first: Accelerate's
state, reset after a DeepSpeed job, takes an FSDP plugin no more), each {"mode": "save" | "load" | "weights",
"strategy": "deepspeed" | "fsdp", "dir": the save_state folder, "steps": N, "truth": file (save: written when
given; load: compared), "negative": file (load), "scheduler": the source's scheduler.bin (load), "fails": true
where the job must end in an error (its result), "state_dict_type": FSDP's (default "SHARDED_STATE_DICT";
"FULL_STATE_DICT": save_state writes pytorch_model_fsdp.bin and optimizer.bin), "config": LlamaConfig fields
over the tiny model's (a benchmark's larger model)}. Both strategies train the same
model on the same data with the same AdamW (lr 1e-2, weight decay 0.01 on the matrices only, two param groups) and
linear-warmup scheduler, so a save of either loads under the other.
save: N steps, a registered custom object counting them, accelerator.save_state(dir); with `truth`, the live state
      ({"fp32/<name>", "exp_avg/<name>", "exp_avg_sq/<name>"}: DeepSpeed's engine_state.engine_tensors, FSDP's full
      state dicts) taken right after and written by rank 0.
load: everything built from another seed, accelerator.load_state(dir); the full state gathered the same way is
      compared with `truth` bit for bit and with `negative` (must differ); every parameter's optimizer step, the
      param groups' weight decay and lr, the scheduler's state_dict (against torch.load of `scheduler`), the custom
      object and the accelerator's step are reported; then one more step runs.
weights (FSDP): the model alone prepared (and the custom object registered), from another seed, then
      accelerator.load_state(dir), its weights-only load: the full model state dict gathered and compared with
      `truth`'s "fp32/" tensors bit for bit, and with `negative`'s (must differ); the custom object and the
      accelerator's step are reported.
Rank 0 writes each job with its {"problems": [...], ...} to RESULTS.json.
"""
import math

from tests.helpers.rank_main import run_main

STATES = ("exp_avg", "exp_avg_sq")
SAMPLES = 32


def main(jobs_path, results_path):
    from tests.scripts.hf_trainer_deepspeed import run_jobs
    run_jobs(jobs_path, results_path, run, first=lambda job: job["strategy"] == "fsdp")


def fsdp_weights(model) -> dict:
    """{"fp32/<name>"} of an FSDP2 model, full (a collective: every rank calls it; offloaded to the CPU, rank 0
    alone gets them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {f"fp32/{name}": value.detach().clone().contiguous() for name, value in weights.items()}


def fsdp_state(model, optimizer) -> tuple:
    """({"fp32/<name>", "exp_avg/<name>", "exp_avg_sq/<name>"}, {name: step}) of an FSDP2 model, full (collectives:
    every rank calls it; offloaded to the CPU, rank 0 alone gets them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    out = fsdp_weights(model)
    optim = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for name, states in optim.get("state", {}).items():
        out.update({f"{state}/{name}": states[state].detach().clone().contiguous() for state in STATES})
    return out, {name: float(states["step"]) for name, states in optim.get("state", {}).items()}


def deepspeed_state(engine) -> tuple:
    """The same of a DeepSpeed engine (engine_state.engine_tensors, its module weights left out), with its torch
    optimizer's steps (ZeRO-2 keeps one per flat group)."""
    from tests.helpers.engine_state import engine_tensors
    tensors = {k: v for k, v in engine_tensors(engine).items() if not k.startswith("module/")}
    state = engine.optimizer.optimizer.state
    return tensors, {str(i): float(s["step"]) for i, s in enumerate(state.values()) if "step" in s}


def run(job) -> dict:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from transformers import LlamaConfig, LlamaForCausalLM, get_linear_schedule_with_warmup

    from tests.helpers.engine_state import differences
    from tests.scripts.accelerate_deepspeed import Counter
    torch.set_num_threads(1)
    fsdp = job["strategy"] == "fsdp"
    if fsdp:
        from tests.helpers.cpu_fsdp import fsdp_on_cpu
        fsdp_on_cpu()
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2,
                                                state_dict_type=job.get("state_dict_type", "SHARDED_STATE_DICT"),
                                                auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    else:
        from tests.scripts.hf_trainer_deepspeed import cpu_deepspeed_backend
        cpu_deepspeed_backend()
        plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                               "steps_per_print": 10**9, "zero_optimization": {"stage": 2}})
        accelerator = Accelerator(deepspeed_plugin=plugin)
    torch.manual_seed(0 if job["mode"] == "save" else 1234)     # load: everything must come from the checkpoint
    config = LlamaConfig(**{"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                            "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32,
                            **job.get("config", {})})
    model = LlamaForCausalLM(config)
    if job["mode"] == "weights":
        return weights_only(job, accelerator, model, differences)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-2)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=20)
    data = list(torch.randint(0, 64, (SAMPLES, 8), generator=torch.Generator().manual_seed(0)))
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    problems, report = [], {"world_size": accelerator.num_processes,
                            "distributed_type": str(accelerator.distributed_type)}
    batches = iter(loader)

    def train_step() -> float:
        batch = next(batches)
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        counter.count += 1
        return float(loss)

    def gathered() -> tuple:
        return fsdp_state(model, optimizer.optimizer) if fsdp else deepspeed_state(model)

    if job["mode"] == "save":
        for _ in range(job["steps"]):
            train_step()
        accelerator.save_state(job["dir"])
        if job.get("truth"):
            tensors, _ = gathered()
            if accelerator.is_main_process:
                from safetensors.torch import save_file
                save_file(tensors, job["truth"])
        report.update(lr=scheduler.get_last_lr()[0], counter=counter.count)
    else:
        from torch.distributed.checkpoint.api import CheckpointException
        try:
            accelerator.load_state(job["dir"])
        except CheckpointException as error:     # a BaseException: run_jobs takes a job's failure as an Exception
            lines = str(error).splitlines()       # each rank's traceback: the first rank's error line says why
            raise RuntimeError("CheckpointException: " + next((x for x in lines if "Error:" in x), lines[0])) from None
        tensors, steps = gathered()
        if accelerator.is_main_process:
            from safetensors.torch import load_file
            truth = load_file(job["truth"])
            problems.extend(differences(tensors, truth))
            saved = torch.load(job["scheduler"], weights_only=True)
            if scheduler.scheduler.state_dict() != saved:
                problems.append(f"scheduler {scheduler.scheduler.state_dict()} != saved {saved}")
            report.update(compared=len(truth), steps=sorted(set(steps.values())),
                          negative_differences=len(differences(tensors, load_file(job["negative"]))))
        report.update(counter=counter.count, lr=scheduler.get_last_lr()[0], accelerator_step=accelerator.step,
                      groups=[[g["weight_decay"], g["lr"]] for g in optimizer.optimizer.param_groups])
        loss = train_step()
        if not math.isfinite(loss):
            problems.append(f"one more step: loss {loss}")
        report.update(next_lr=scheduler.get_last_lr()[0], next_steps=sorted(set(gathered()[1].values())))
    if fsdp:
        dist.barrier()
    else:
        from tests.scripts.hf_trainer_deepspeed import release
        release(model)
    return {"problems": problems, **report}


def weights_only(job, accelerator, model, differences) -> dict:
    """The "weights" job: load_state of a folder with the model alone prepared, its weights against the truth's."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from tests.scripts.accelerate_deepspeed import Counter
    model = accelerator.prepare(model)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    accelerator.load_state(job["dir"])
    loaded = fsdp_weights(model)
    report: dict = {"counter": counter.count, "accelerator_step": accelerator.step}
    problems: list = []
    if accelerator.is_main_process:
        truth = {k: v for k, v in load_file(job["truth"]).items() if k.startswith("fp32/")}
        negative = {k: v for k, v in load_file(job["negative"]).items() if k.startswith("fp32/")}
        problems = differences(loaded, truth)
        report.update(compared=len(truth), negative_differences=len(differences(loaded, negative)))
    dist.barrier()
    return {"problems": problems, **report}


if __name__ == "__main__":
    run_main(main, 2)
