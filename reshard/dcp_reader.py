"""Load any checkpoint reshard reads with PyTorch DCP, at any topology, with no conversion step:

    msd, osd = get_state_dict(model, optim)
    dcp.load({"model": msd, "optim": osd}, storage_reader=reshard.dcp_reader.Reader("ckpt/"))
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)

Each rank reads only the elements of its own shards. See reshard.live.storage_reader.
"""
from reshard.live.storage_reader import Reader

__all__ = ["Reader"]
