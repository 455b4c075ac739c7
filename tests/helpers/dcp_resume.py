"""A training script's resume of a fixture model through dcp.load (get_state_dict / set_state_dict), and the check
that it holds the engine's truth and trains one more step."""
from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fixture_model import build_model, make_batch
from tests.helpers.fixtures import truth_json, truth_tensors


def resume_fixture_model(name, reader, dtype=torch.float32):
    """A fresh model and optimizer of the fixture's kind, loaded the way a training script resumes."""
    model = build_model(tied="tied" in name, frozen="frozen" in name, seed=99).to(dtype)
    named = dict(model.named_parameters())
    # the param groups the run trained with (their hyper-parameters come from the checkpoint)
    groups = [{"params": [named[n] for n in g["param_names"]]} for g in truth_json(name)["param_groups"]]
    optim = torch.optim.SGD(groups, lr=0.5, momentum=0.9) if "sgd" in name else \
        torch.optim.AdamW(groups, lr=0.5, weight_decay=0.3)
    msd, osd = get_state_dict(model, optim)
    dcp.load({"model": msd, "optim": osd}, storage_reader=reader)
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    return model, optim


def assert_resumed_as_truth(name, model, optim):
    """The fixture model and optimizer hold the engine's truth of fixture `name`, and train one more step."""
    truth, info = truth_tensors(name), truth_json(name)
    for n, p in model.named_parameters():
        expected = truth[f"fp32/{n}"] if p.requires_grad else truth[f"module/{n}"].float()
        assert torch.equal(p.detach(), expected), n
        for state in optim.state[p] if p.requires_grad else ():
            if state != "step":
                assert torch.equal(optim.state[p][state], truth[f"{state}/{n}"]), (n, state)
            else:
                assert float(optim.state[p]["step"]) == info["global_steps"]
    saved_groups = info["param_groups"]
    assert len(optim.param_groups) == len(saved_groups)
    for group, saved in zip(optim.param_groups, saved_groups, strict=True):
        assert (group["lr"], group["weight_decay"]) == (saved["lr"], saved["weight_decay"])   # not the script's
    assert torch.equal(model.pos, torch.arange(5)) and torch.equal(model.scale, torch.tensor([1.0, 0.5, 0.25]))
    loss = model(make_batch(99, 0))
    loss.backward()
    optim.step()
    assert torch.isfinite(loss)
