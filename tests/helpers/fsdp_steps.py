"""The HF Trainer and Accelerate FSDP fixtures' model (tools/fixture_hf_fsdp.py, fixture_accelerate_fsdp.py), and the
proof both make that one parameter's Adam step behind the others is carried to FSDP and refused for DeepSpeed."""
from __future__ import annotations

import shutil

import torch

from tests.helpers.cli import run_cli
from tests.helpers.fsdp_truths import STATES


def config():
    """The tiny Llama tools/fixture_hf_fsdp.py trained (tests/scripts/hf_trainer_fsdp.py): the sharded save holds no
    config.json (the Trainer saves none with FSDP's sharded state dict)."""
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)


def one_step_behind_is_carried_or_refused(source, optimizer: dict, behind: str, refusal: str, tmp_path):
    """`behind`'s Adam step set one behind the others in the FSDP folder `source` (torch's own torch_save_to_dcp
    rewrites optimizer_0/ from `optimizer`, its consolidated truth): DeepSpeed output is refused with the one line
    `refusal` naming optimizer_0/.metadata, nothing written; the FSDP layout at 3 processes carries every
    parameter's own step, the param groups and both moments exactly (read back with dcp_to_torch_save). Returns that
    output's folder."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
    optim = dict(optimizer)
    optim["state"] = {name: dict(states) for name, states in optimizer["state"].items()}
    optim["state"][behind]["step"] = torch.tensor(2.0)
    torch.save({"optimizer": optim}, tmp_path / "behind.pt")
    shutil.rmtree(source / "optimizer_0")
    torch_save_to_dcp(tmp_path / "behind.pt", source / "optimizer_0")
    proc = run_cli("convert", source, tmp_path / "ds", "--format", "deepspeed", "--to", "dp=2,zero=2")
    assert proc.returncode == 1 and not (tmp_path / "ds").exists()
    assert proc.stderr.strip().splitlines() == [f"reshard: {source / 'optimizer_0' / '.metadata'}: {refusal}"]
    run_cli("convert", source, tmp_path / "fsdp3", "--format", "fsdp", "--to", "dp=3", "--quiet", check=0)
    dcp_to_torch_save(tmp_path / "fsdp3" / "optimizer_0", tmp_path / "carried.pt")
    carried = torch.load(tmp_path / "carried.pt")["optimizer"]
    assert {n: float(s["step"]) for n, s in carried["state"].items()} == \
        {n: 2.0 if n == behind else 3.0 for n in optimizer["state"]}
    assert carried["param_groups"] == optimizer["param_groups"]
    assert all(torch.equal(carried["state"][n][s], optimizer["state"][n][s]) for n in carried["state"] for s in STATES)
    return tmp_path / "fsdp3"
