"""Load torch_dist saves' tensors with megatron-core 0.16.1's own `dist_checkpointing.load_plain_tensors` (torchrun,
gloo, CPU), every job of the launch in turn.

    torchrun --nproc_per_node 1 tests/scripts/megatron_plain_load.py JOBS.json RESULTS.json

JOBS.json lists {"label", "folder": a torch_dist folder (a verl role folder's model/dist_ckpt), "out": where rank 0
writes every tensor it loads (safetensors, under its ShardedTensor key: a layer stack whole, its leading axis the
layer)}. megatron-core gathers each tensor from its chunks by the folder's own `.metadata` through torch's DCP load;
reshard is not imported. Rank 0 writes {"label", "loaded", "error", "keys"} per job.
"""
from tests.helpers.rank_main import gloo_jobs, run_main


def main(jobs_path, results_path):
    import megatron_cpu
    megatron_cpu.install()
    import fixture_megatron_core
    try:
        gloo_jobs(_job, jobs_path, results_path)
    finally:    # the torch_dist loader's helper processes would hold torchrun's output pipes open
        fixture_megatron_core.end_helpers()


def _job(job) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from safetensors.torch import save_file
    try:
        loaded = dist_checkpointing.load_plain_tensors(job["folder"])
    except Exception as e:      # (what megatron-core raised, for the test to show)
        return {"label": job["label"], "loaded": False, "error": str(e).splitlines()[0], "keys": []}
    tensors = {k: v.contiguous() for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    if dist.get_rank() == 0:
        save_file(tensors, job["out"])
    return {"label": job["label"], "loaded": True, "error": None, "keys": sorted(tensors)}


if __name__ == "__main__":
    run_main(main, 2)
