"""Accelerate's save_state with automatic checkpoint naming, one process on CPU (no DeepSpeed, no FSDP), and its
load_state of the model alone.

    python tests/scripts/accelerate_save_state.py PROJECT_DIR STEPS [VARIANT ...]
    python tests/scripts/accelerate_save_state.py load OUT DIR [DIR ...]

A small MLP (nn.Sequential of Linear(4, 6), ReLU, Linear(6, 3): its parameters' shapes all differ, and its
parameter order, each weight before its bias, is not the names' sorted order), AdamW and a LambdaLR prepared by
Accelerator(cpu=True); one save_state() after each of STEPS steps: PROJECT_DIR/checkpoints/checkpoint_0 ..
checkpoint_{STEPS-1}, each model.safetensors, optimizer.bin, scheduler.bin and random_states_0.pkl. With VARIANTs,
one run each into PROJECT_DIR/VARIANT/: "safetensors" (as above), "bin" (save_state(safe_serialization=False):
pytorch_model.bin) and "twin" (two Linear(4, 4): parameters of equal shapes). Each run writes its parameters' names
in the model's order to params.json beside checkpoints/.

load: a fresh model of the same architecture (another seed), prepared alone (no optimizer, no scheduler), and
accelerator.load_state(DIR) for each DIR in turn, its state dict then saved to OUT/K.safetensors (K: the DIR's
position) or the error recorded; then an AdamW prepared too and load_state(the first DIR) tried again: OUT/results.json
holds {"loaded": [null or the error, per DIR], "with_optimizer": null or the error}. A process of its own:
Accelerate's state is process-global.
"""
import json
import os
import sys


def build(variant: str):
    import torch
    if variant == "twin":
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


def save(project_dir: str, steps: int, variant: str) -> None:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=project_dir,
                                                                            automatic_checkpoint_naming=True))
    model = build(variant)
    names = [n for n, _ in model.named_parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    for _ in range(steps):
        accelerator.backward(model(torch.randn(2, 4)).sum())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        accelerator.save_state(safe_serialization=variant != "bin")
    with open(os.path.join(project_dir, "params.json"), "w") as f:
        json.dump(names, f)


def load(out: str, dirs: list) -> None:
    import torch
    from accelerate import Accelerator
    from safetensors.torch import save_file

    torch.manual_seed(1)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(build("safetensors"))
    loaded = []
    for k, folder in enumerate(dirs):
        try:
            accelerator.load_state(folder)
        except Exception as e:      # (what the load says is the result)
            loaded.append(f"{type(e).__name__}: {e}")
            continue
        save_file({n: t.detach().clone() for n, t in model.state_dict().items()}, os.path.join(out, f"{k}.safetensors"))
        loaded.append(None)
    accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    try:
        accelerator.load_state(dirs[0])
        with_optimizer = None
    except Exception as e:
        with_optimizer = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"loaded": loaded, "with_optimizer": with_optimizer}, f)


if __name__ == "__main__":
    if sys.argv[1] == "load":
        load(sys.argv[2], sys.argv[3:])
    else:
        for variant in sys.argv[3:] or [""]:
            save(os.path.join(sys.argv[1], variant), int(sys.argv[2]), variant)
