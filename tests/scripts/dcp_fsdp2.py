"""The real PyTorch clients of a DCP checkpoint, run under torchrun (CPU, gloo): FSDP2 + torch.optim.

    torchrun --nproc_per_node N tests/scripts/dcp_fsdp2.py load JOBS.json
    torchrun --nproc_per_node N tests/scripts/dcp_fsdp2.py train DCP_DIR TRUTH.pt [SOURCE_2D]

`load`: for each job {"dcp", "out", "tied", "frozen", "two_groups", "optimizer", "hyper"} every
rank builds the fixture model (tools/fixture_model.py), shards it with `fully_shard`, makes the
optimizer over the same param groups (with a deliberately wrong lr, which the checkpoint must
replace), and loads the checkpoint the documented way: `get_state_dict` -> `dcp.load` ->
`set_state_dict`. Rank 0 then torch.saves the gathered full state (params, buffers, optimizer
state and param groups) to "out" for the test to compare. A job with "source" and "reader_out" also
(or only) loads that checkpoint, of any format, through `reshard.dcp_reader.Reader`, then trains one step.
"model" names another model than the fixture model: "llama" (the AutoTP fixtures' LlamaForCausalLM, from
"hf_config"), "gpt2" (tests/scripts/hf_trainer_deepspeed.py's, with the Trainer's two param groups), "pipe" and
"tied_head" (the pipeline fixtures' layers as one module), "mixtral" (the MoE fixtures' MixtralForCausalLM,
tools/fixture_moe.py, with AutoEP's two param groups: the dense params, then the experts); "names" is the Reader's
module-names rule file.

`train`: a few Adam steps of the untied fixture model under FSDP2, then `dcp.save` of
{"model", "optim"} from `get_state_dict`, and the gathered full state to TRUTH.pt. Also
DCP_DIR-boxes: DTensors cut into column shards and into a 2x2 grid (boxes no dim-0 shard
gives), with their full values in TRUTH.pt under "boxes". With SOURCE_2D, also the fixture model
on a 2-D (dp x tp) mesh loaded from that checkpoint through reshard.dcp_reader.Reader (TRUTH.pt "mesh_2d").
"""
import copy
import json

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from fixture_model import build_model, make_batch, param_groups
from tests.helpers.rank_main import run_main

OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD}


class PipeAsModule(torch.nn.Module):
    """A pipe fixture's PipelineModule (tools/fixture_parallel.py) as one module: its layers under their
    PipelineModule indices and the tied embedding under tied_modules.emb, so its names are the checkpoint's.
    The embedding embeds the tokens and, at the end, projects back to the vocabulary."""

    def __init__(self, tied_head: bool):
        from fixture_parallel import HIDDEN, TIED_HEAD_WIDTHS, Block, Embed, TiedEmbed
        super().__init__()
        self.tied_modules = torch.nn.ModuleDict({"emb": TiedEmbed() if tied_head else Embed()})
        layers = [*map(Block, TIED_HEAD_WIDTHS), torch.nn.LayerNorm(HIDDEN)] if tied_head else \
            [Block(10), torch.nn.LayerNorm(HIDDEN), Block(6)]
        self.layers = len(layers)
        for index, layer in enumerate(layers, start=1):
            self.add_module(str(index), layer)

    def forward(self, tokens):
        weight = self.tied_modules.emb.weight
        h = torch.nn.functional.embedding(tokens, weight)
        for index in range(1, self.layers + 1):
            h = getattr(self, str(index))(h)
        return h @ weight.t()


def _tokens(vocab, rank):
    return (torch.arange(2 * 10).reshape(2, 10) * 7 + rank) % vocab


def built(job):
    """The job's model, sharded with fully_shard (its blocks first, where it has them), its param groups as
    its run trained them, and a function giving the loss of one training batch."""
    kind = job.get("model", "fixture")
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(job["hf_config"]))
        blocks = model.model.layers
    elif kind == "gpt2":
        from transformers import GPT2LMHeadModel

        from tests.helpers.single_models import gpt2_config
        model = GPT2LMHeadModel(gpt2_config())
        blocks = model.transformer.h
    elif kind == "mixtral":
        from transformers import MixtralForCausalLM

        from fixture_moe import mixtral_config
        model = MixtralForCausalLM(mixtral_config())
        blocks = model.model.layers
    elif kind in ("pipe", "tied_head"):
        model, blocks = PipeAsModule(tied_head=kind == "tied_head"), []
    else:
        model, blocks = build_model(tied=job.get("tied", False), frozen=job.get("frozen", False)), []
    for block in blocks:
        fully_shard(block)
    fully_shard(model)          # (it replaces the params: the groups are made of the sharded ones)
    if kind == "gpt2":
        from tests.helpers.single_models import trainer_param_groups
        named = dict(model.named_parameters())
        groups = [{"params": [named[n] for n in g["names"]], "weight_decay": g["weight_decay"]}
                  for g in trainer_param_groups(model, 0.01)]
    elif kind == "mixtral":        # as DeepSpeed AutoEP groups them: the experts apart
        named = list(model.named_parameters())
        groups = [{"params": [p for n, p in named if ".experts." not in n]},
                  {"params": [p for n, p in named if ".experts." in n]}]
    elif kind == "fixture":
        groups, _ = param_groups(model, two_groups=job.get("two_groups", False))
        groups = groups if job.get("two_groups") else [{"params": groups}]
    else:
        groups = [{"params": list(model.parameters())}]

    def loss_of(rank):
        if kind == "fixture":
            return model(make_batch(100, rank))
        if kind in ("llama", "gpt2", "mixtral"):
            tokens = _tokens(model.config.vocab_size, rank)
            return model(input_ids=tokens, labels=tokens).loss
        tokens = _tokens(model.tied_modules.emb.weight.shape[0], rank)
        logits = model(tokens)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1))
    return model, groups, loss_of


def make(job):
    """The job's model, its optimizer (over its param groups, `lr` and the job's "hyper"), and its loss_of."""
    model, groups, loss_of = built(job)
    hyper = job.get("hyper") or [{} for _ in groups]
    for group, h in zip(groups, hyper, strict=True):
        group.update(h)
    cls = OPTIMIZERS[job.get("optimizer", "AdamW")]
    kwargs = {"momentum": 0.9} if cls is torch.optim.SGD else {}
    return model, cls(groups, lr=job.get("lr", 0.01), **kwargs), loss_of


def gathered(model, optim):
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optim, options=full)
    # copies: a one-element step is the optimizer's own tensor, which the next step changes in place
    return {"model": {k: v.clone() for k, v in msd.items()}, "optim": copy.deepcopy(osd)}


def load(jobs_path):
    with open(jobs_path) as f:
        jobs = json.load(f)
    for job in jobs:
        if "dcp" in job:
            load_one(job, job["out"], checkpoint_id=job["dcp"])
        if "source" in job:     # the original checkpoint, whatever its format, through reshard's StorageReader
            import reshard.dcp_reader
            reader = reshard.dcp_reader.Reader(job["source"], names=job.get("names"))
            load_one(job, job["reader_out"], storage_reader=reader, then_step=True)


def load_one(job, out, then_step=False, **where):
    # a wrong lr: the checkpoint's param groups must replace it
    model, optim, loss_of = make({**job, "lr": 123.0, "hyper": [{k: v for k, v in h.items() if k != "lr"}
                                                                         for h in job.get("hyper") or []] or None})
    msd, osd = get_state_dict(model, optim)
    dcp.load({"model": msd, "optim": osd}, **where)
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    result = gathered(model, optim)
    if then_step:           # and training goes on from there
        loss = loss_of(dist.get_rank())
        loss.backward()
        optim.step()
        result["next_loss"] = float(loss)
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.barrier()


def load_2d(source):
    """The fixture model on a 2-D mesh (dp x tp): l1 column-sharded and l2 row-sharded over tp, then
    fully_shard over dp; loaded from `source` (any format) through reshard.dcp_reader.Reader."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import reshard.dcp_reader
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    model = build_model()
    parallelize_module(model, mesh["tp"], {"l1": ColwiseParallel(), "l2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    optim = torch.optim.AdamW(model.parameters(), lr=123.0)
    msd, osd = get_state_dict(model, optim)
    dcp.load({"model": msd, "optim": osd}, storage_reader=reshard.dcp_reader.Reader(source))
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    result = gathered(model, optim)
    # (no training step: the fixture's odd widths, 19, make DTensor's uneven TP x FSDP forward fail)
    result["placements"] = {name: str(p.placements) for name, p in model.named_parameters()}
    return result


def train(dcp_dir, truth_path, source_2d=None, steps=3):
    model, optim, _ = make({"optimizer": "Adam", "lr": 0.01})
    rank = dist.get_rank()
    for step in range(steps):
        loss = model(make_batch(step, rank))
        loss.backward()
        optim.step()
        optim.zero_grad()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)
    result = gathered(model, optim)
    result["boxes"] = save_boxes(dcp_dir + "-boxes")
    if source_2d:
        result["mesh_2d"] = load_2d(source_2d)
    if rank == 0:
        torch.save(result, truth_path)
    dist.barrier()


def save_boxes(path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    full = {"cols": torch.arange(5 * 12, dtype=torch.float32).reshape(5, 12) / 7,
            "grid": torch.arange(6 * 8 * 3, dtype=torch.float32).reshape(6, 8, 3) - 50}
    line = init_device_mesh("cpu", (dist.get_world_size(),))
    grid = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("a", "b"))
    state = {"cols": distribute_tensor(full["cols"], line, [Shard(1)]),
             "grid": distribute_tensor(full["grid"], grid, [Shard(0), Shard(1)])}
    dcp.save({"model": state}, checkpoint_id=path)
    return full


def main(command, *args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if command == "load":
        load(*args)
    else:
        train(*args)


if __name__ == "__main__":
    run_main(main)
