"""The files a Hugging Face folder holds beside the weights for `from_pretrained` and `AutoTokenizer`: the model's
config, its generation config, the tokenizer's and processor's files. Every HF Trainer checkpoint-N/ has them
(config.json always; the tokenizer's when the Trainer was given one), whatever backend saved the weights, and so
does a save_pretrained folder. An export copies those present, byte for byte, so its folder loads as the model.
"""
from __future__ import annotations

import os

from reshard.storage import files as fs

CONFIGS = ("config.json", "generation_config.json")
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
             "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
             "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json",
             "video_preprocessor_config.json")
NAMES = CONFIGS + TOKENIZER
# FSDP's full state dict as HF Trainer and Accelerate save it: the gathered module and optimizer state dicts; and
# Accelerate's first LR scheduler (the single-process reader reads these; the framework modules name them too)
FSDP_FULL_MODEL, FSDP_FULL_OPTIMIZER = "pytorch_model_fsdp.bin", "optimizer.bin"
ACCELERATE_SCHEDULER = "scheduler.bin"


def present(folder: str) -> tuple:
    """Absolute paths of the files of NAMES that `folder` holds, in NAMES order."""
    folder = fs.abspath(folder)
    return tuple(os.path.join(folder, n) for n in NAMES if fs.isfile(os.path.join(folder, n)))
