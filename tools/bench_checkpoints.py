"""The checkpoints of issue #13's benchmarks, made by the real engines (run under torchrun by tools/bench.py).

    torchrun --nproc_per_node TP*DP tools/bench_checkpoints.py tp DIR TP LAYERS VOCAB
        A random Hugging Face Llama at realistic width (hidden 4096, intermediate 11008, 32 heads, 8
        key-value heads), trained one step by DeepSpeed with AutoTP ("tensor_parallel": {"autotp_size": TP}),
        bf16, ZeRO-1, saved with engine.save_checkpoint to DIR/checkpoint; DIR/hf_config from rank 0.
    torchrun --nproc_per_node RANKS tools/bench_checkpoints.py dcp DIR TENSORS
        TENSORS 4096x11008 fp32 weights, each a DTensor column-sharded (Shard(1)) over RANKS, with the
        Adam state (exp_avg, exp_avg_sq, step) of one step, saved by dcp.save as {"model", "optim"}.
    torchrun --nproc_per_node EP tools/bench_checkpoints.py moe DIR EP [STAGE]
        A random Hugging Face Mixtral (moe_config: hidden 512, 8 experts in each of 2 layers), trained one
        step by DeepSpeed with AutoEP at ep EP (moe_engine_config: ZeRO STAGE, default 2, fp32), saved to DIR
        (0.44 GB).
"""
import os
import sys

from torchrun_jobs import run_rank

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 4096, 11008, 32, 8


def llama_config(layers, vocab, intermediate=INTERMEDIATE):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=int(intermediate),
                       num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       max_position_embeddings=64, tie_word_embeddings=False)


def tp_config(tp):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
            "tensor_parallel": {"autotp_size": tp}}


def save_tp(out, tp, layers, vocab, intermediate=INTERMEDIATE):
    import deepspeed
    import torch
    from deepspeed.utils import groups
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(int(layers), int(vocab), int(intermediate)))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=tp_config(int(tp)))
    # the TP ranks of a data-parallel group see the same batch
    generator = torch.Generator().manual_seed(groups.get_data_parallel_rank())
    ids = torch.randint(0, int(vocab), (1, 16), generator=generator)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(os.path.join(out, "checkpoint"))
    if deepspeed.comm.get_rank() == 0:
        engine.module.config.save_pretrained(os.path.join(out, "hf_config"))
    deepspeed.comm.barrier()


def moe_config():
    from transformers import MixtralConfig
    return MixtralConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=64)


def moe_engine_config(ep, stage=2):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": int(stage)},
            "expert_parallel": {"enabled": True, "autoep_size": int(ep), "preset_model": "mixtral"}}


def save_moe(out, ep, stage=2):
    import deepspeed
    import torch
    from transformers import MixtralForCausalLM

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = MixtralForCausalLM(moe_config())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=moe_engine_config(ep, stage))
    ids = torch.randint(0, 1024, (1, 16), generator=torch.Generator().manual_seed(deepspeed.comm.get_rank()))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(out)
    deepspeed.comm.barrier()


def save_dcp(out, tensors):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # TENSORS separate Linear(11008 -> 4096) layers: weights of 4096x11008, each column-sharded, a cut DCP keeps
    # as one chunk per rank that is no dim-0 block; one Adam step on a random gradient of the same placement
    model = torch.nn.Sequential(*[torch.nn.Linear(INTERMEDIATE, HIDDEN, bias=False) for _ in range(int(tensors))])
    generator = torch.Generator().manual_seed(0)
    for layer in model:
        layer.weight = torch.nn.Parameter(distribute_tensor(torch.randn(HIDDEN, INTERMEDIATE, generator=generator),
                                                            mesh, [Shard(1)]))
        layer.weight.grad = distribute_tensor(torch.randn(HIDDEN, INTERMEDIATE, generator=generator), mesh, [Shard(1)])
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    optim.step()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    dist.barrier()


if __name__ == "__main__":
    run_rank({"tp": save_tp, "dcp": save_dcp, "moe": save_moe}[sys.argv[1]], *sys.argv[2:])
