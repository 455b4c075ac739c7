"""Lightning's DeepSpeedStrategy: a `*.ckpt/` folder that is DeepSpeed's save dir (tag `checkpoint`), with
nothing of Lightning's beside it. Lightning hands engine.save_checkpoint its whole checkpoint dict less weights
and optimizer states (epoch, global_step, loops, callbacks, lr_schedulers, hparams) as DeepSpeed's client state,
which every conversion carries; so it has no files of its own to carry, rename or drop at another size.
"""
from __future__ import annotations

from reshard.formats.framework.files import Framework

NAME = "Lightning"
# always in the client state Lightning's DeepSpeedStrategy.save_checkpoint hands DeepSpeed
VERSION_KEY = "pytorch-lightning_version"
BATCH = "Lightning takes them from Trainer(accumulate_grad_batches=) and the DataLoader's batch_size"


def detect(folder: str, client_state: dict) -> Framework | None:
    """Lightning, when the DeepSpeed save's client state is its checkpoint dict."""
    if VERSION_KEY not in client_state:
        return None
    return Framework(NAME, folder, (), (), batch_note=BATCH)
