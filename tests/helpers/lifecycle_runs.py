"""Run directories for the lifecycle tests (`reshard list`, `reshard prune`), made of real checkpoints.

- a DeepSpeed save dir: tag folders `global_stepN` copied from the committed fixtures (real engine output), one
  written into it by `reshard convert --tag-out`, a ZeRO-3 save left with rank 0's files only and one with a
  truncated rank file; `latest` names the newest;
- a DCP save loop: real `dcp.save` calls (one process) of a model and its AdamW state, one `step-N/` per step;
- a Hugging Face Trainer run whose save_steps and eval_steps do not line up, and a Lightning run whose
  ModelCheckpoint monitors a validation loss.
Checkpoints written by a test are aged (their mtimes set back) so `list` does not take them for saves in progress.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from tests.helpers.cli import run_cli
from tests.helpers.fixtures import fixture_dir

HOUR = 3600


def age(path, seconds: float = HOUR) -> None:
    """Set every mtime under `path` back by `seconds`: a save that finished long ago."""
    when = time.time() - seconds
    for folder, dirs, files in os.walk(path):
        for name in files + dirs:
            p = os.path.join(folder, name)
            if not os.path.islink(p):
                os.utime(p, (when, when))
    os.utime(path, (when, when))


def copy_tag(fixture: str, tag: str, save_dir: Path, as_tag: str) -> Path:
    dst = save_dir / as_tag
    shutil.copytree(fixture_dir(fixture) / tag, dst)
    return dst


def deepspeed_run(root: Path) -> Path:
    """`root/ds`: global_step1..3, 6 and 8 whole (ZeRO-2 dp=2, copies of a real save), global_step7 written by
    `reshard convert --tag-out` (dp=3), global_step4 a ZeRO-3 dp=4 save whose ranks 1-3 wrote nothing,
    global_step5 with a truncated optimizer file; `latest` names global_step8."""
    ds = root / "ds"
    shutil.copytree(fixture_dir("z2_fp32_dp2"), ds)
    shutil.rmtree(ds / "global_step2")
    (ds / "global_step3").rename(ds / "global_step8")
    for step in (1, 2, 3, 6):
        copy_tag("z2_fp32_dp2", "global_step3", ds, f"global_step{step}")
    broken = copy_tag("z3_fp32_dp4", "global_step3", ds, "global_step4")
    for f in broken.iterdir():
        if not f.name.startswith("zero_pp_rank_0_"):
            f.unlink()
    truncated = copy_tag("z2_fp32_dp2", "global_step3", ds, "global_step5")
    optim = truncated / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with open(optim, "r+b") as f:
        f.truncate(optim.stat().st_size // 2)
    converted = root / "converted"
    run_cli("convert", fixture_dir("z2_fp32_dp2"), converted, "--to", "dp=3", "--tag-out", "global_step7", check=0)
    (converted / "global_step7").rename(ds / "global_step7")
    shutil.rmtree(converted)
    (ds / "latest").write_text("global_step8")
    age(root)
    return ds


def dcp_loop(root: Path, steps) -> Path:
    """Real `dcp.save` calls, one per step in `steps`, into `root/dcp/step-N/`."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from fixture_model import build_model, make_batch, param_groups

    torch.manual_seed(0)
    model = build_model(tied=False)
    groups, _ = param_groups(model, two_groups=False)
    optim = torch.optim.AdamW(groups, lr=0.01)
    out = root / "dcp"
    for step in range(1, max(steps) + 1):
        model(make_batch(step, 0)).backward()
        optim.step()
        optim.zero_grad()
        if step in steps:
            msd, osd = get_state_dict(model, optim)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(out / f"step-{step}"), no_dist=True)
    age(out)
    return out


def hf_run(root: Path, max_steps: int = 8, save_steps: int = 2, eval_steps: int = 3):
    """A real transformers.Trainer run (tiny GPT-2, CPU) evaluating every `eval_steps` and saving every
    `save_steps`; returns (output dir, the trainer's final state)."""
    import torch
    from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

    from tests.helpers import single_models as sm

    torch.manual_seed(0)
    model = GPT2LMHeadModel(sm.gpt2_config())
    data = [{"input_ids": t, "labels": t} for t in (sm.tokens(i, batch=1)[0] for i in range(2 * max_steps))]
    args = TrainingArguments(output_dir=str(root / "hf"), max_steps=max_steps, save_steps=save_steps,
                             eval_strategy="steps", eval_steps=eval_steps, metric_for_best_model="eval_loss",
                             per_device_train_batch_size=2, learning_rate=1e-2, use_cpu=True, report_to=[],
                             logging_steps=1, disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4])
    trainer.train()
    age(root / "hf")
    return root / "hf", trainer.state


def lightning_run(root: Path, epochs: int = 4):
    """A real Lightning fit, validating each epoch, ModelCheckpoint(monitor="val_loss", save_top_k=-1); returns
    (checkpoint dir, {path: score} as the live callback holds them, its best_model_path)."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.helpers import single_lightning as sl, single_models as sm

    class LitEval(sl.LitTiny):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self(batch))

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader([sm.tokens(i, batch=1)[0] for i in range(4)], batch_size=2)
    out = root / "lightning"
    callback = ModelCheckpoint(dirpath=str(out), monitor="val_loss", save_top_k=-1, filename="{epoch}-{step}")
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    trainer.fit(LitEval(), data, data)
    age(out)
    return out, {k: float(v) for k, v in callback.best_k_models.items()}, callback.best_model_path


def snapshot(path: Path) -> dict:
    """{relative path: bytes} of every file under `path`: what must not change."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def ds_run(root, fixture: str):
    """A save dir of `fixture`'s step 3 copied as global_step1 and 2 beside it; `latest` names global_step3."""
    save = root / fixture
    shutil.copytree(fixture_dir(fixture), save)
    for step in (1, 2):     # (a fixture's own global_step2 is another step's: the truth is step 3's)
        shutil.rmtree(save / f"global_step{step}", ignore_errors=True)
        copy_tag(fixture, "global_step3", save, f"global_step{step}")
    age(save)
    return save
