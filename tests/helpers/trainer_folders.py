"""A real DeepSpeed save dressed as HF Trainer's checkpoint-N/: the Trainer's files beside `latest`, their contents
arbitrary bytes (reshard only copies them) and training_args.bin a hostile pickle."""
from __future__ import annotations

import json
import os
import pickle
import shutil

from tests.helpers.fixtures import fixture_dir


class Hostile:
    """Unpickling this runs a command: a reader that loads training_args.bin would be refused (or worse)."""
    def __reduce__(self):
        return (os.system, ("echo unpickled > /dev/null",))


def hf_folder(tmp_path, ranks=(0, 1), name="checkpoint-3"):
    """A DeepSpeed ZeRO-2 dp=2 save (fixture z2_fp32_dp2) with HF Trainer's files beside `latest`."""
    folder = tmp_path / name
    shutil.copytree(fixture_dir("z2_fp32_dp2"), folder)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 3, "epoch": 0.25, "log_history": []}))
    (folder / "scheduler.pt").write_bytes(b"scheduler bytes")
    (folder / "training_args.bin").write_bytes(pickle.dumps(Hostile()))
    (folder / "config.json").write_text('{"model_type": "gpt2"}')
    for rank in ranks:
        (folder / f"rng_state_{rank}.pth").write_bytes(f"rng of process {rank}".encode() * 10)
    return folder
