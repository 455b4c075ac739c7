"""Test-only: verl 0.9.1's FSDP actor, as its FSDP workers build it, on CPU (gloo), without Ray.

verl's own ``verl/__init__.py`` imports ``verl.protocol`` (Ray, its DataProto) and ``verl/utils/checkpoint/__init__.py``
imports the Ray single controller; neither is used by ``FSDPCheckpointManager`` itself, and Ray is not installed
(pyproject's dev extras say why). ``install`` registers those two packages with their search path only, so
``verl.utils.checkpoint.fsdp_checkpoint_manager`` and ``verl.utils.fsdp_utils`` import as verl ships them and
nothing else of verl is patched.

``actor`` builds what verl's FSDP worker builds for its actor: a Hugging Face causal LM, wrapped by FSDP1
(``FullyShardedDataParallel``, ``use_orig_params=False``, verl's transformer-layer wrap policy, FULL_SHARD over a 1-D
device mesh) or FSDP2 (verl's ``apply_fsdp2``), AdamW and a warmup schedule, and verl's ``FSDPCheckpointManager``.
``critic`` builds its critic the same way around the value model verl's FSDP engine loads for it
(``verl/workers/engine/fsdp/transformer_impl.py``: ``load_valuehead_model``, transformers'
``AutoModelForTokenClassification`` with ``num_labels=1`` and its dropouts at 0).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import types

VERL = "0.9.1"
VOCAB, SEQ, LR, WARMUP = 32, 8, 1e-2, 2


def install() -> None:
    """Make verl's checkpoint manager importable without its Ray-bound package initialisers."""
    if "verl" in sys.modules:
        return
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("verl is not installed: pip install --no-deps verl==" + VERL)
    root = spec.submodule_search_locations[0]
    for name, sub in (("verl", ""), ("verl.utils", None), ("verl.utils.checkpoint", "utils/checkpoint")):
        if sub is None:
            importlib.import_module(name)       # its __init__ imports nothing of Ray
            continue
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(root, sub)]
        package.__version__ = VERL
        sys.modules[name] = package


def config():
    from transformers import Qwen2Config
    return Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2 * SEQ,
                       tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def tokenizer():
    """A word-level tokenizer of VOCAB tokens, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"<unk>": VOCAB - 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="t0", eos_token="t0",
                                   pad_token="t0")


ROLES = ("actor", "critic")


def actor(fsdp: int, seed: int = 0, model_config=None):
    """(model, optimizer, lr_scheduler, checkpoint manager) of a verl FSDP actor at this process group's size, of
    `model_config` (default the fixtures' tiny Qwen2, `config()`)."""
    install()
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    return _wrapped(AutoModelForCausalLM.from_config(model_config or config(), dtype=torch.float32), fsdp)


def critic(fsdp: int, seed: int = 0):
    """The same of verl's FSDP critic: the fixtures' Qwen2 as the value model verl loads (a token classifier of one
    label, its dropouts off, as verl's FSDP engine sets them)."""
    install()
    import torch
    from transformers import AutoModelForTokenClassification
    value = config()
    value.num_labels, value.classifier_dropout, value.hidden_dropout, value.summary_dropout_prob = 1, 0.0, "0", 0.0
    torch.manual_seed(seed)
    return _wrapped(AutoModelForTokenClassification.from_config(value, dtype=torch.float32), fsdp)


def role(name: str, fsdp: int, seed: int = 0):
    """actor() or critic() by the role's folder name."""
    return {"actor": actor, "critic": critic}[name](fsdp, seed)


def _wrapped(module, fsdp: int):
    """`module` wrapped as verl's FSDP workers wrap it, its optimizer, lr scheduler and checkpoint manager."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import get_constant_schedule_with_warmup
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.fsdp_utils import apply_fsdp2, get_fsdp_wrap_policy
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    if fsdp == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        model = FullyShardedDataParallel(module, auto_wrap_policy=get_fsdp_wrap_policy(module, config=None),
                                         use_orig_params=False, sharding_strategy=ShardingStrategy.FULL_SHARD,
                                         device_mesh=mesh, device_id=torch.device("cpu"))
        # verl also passes sync_module_states=True (rank 0's weights broadcast), which FSDP1 refuses on CPU; every
        # rank here builds the same weights from the same seed instead
    else:
        apply_fsdp2(module, {"mesh": mesh, "reshard_after_forward": True}, {})
        model = module
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.01)
    scheduler = get_constant_schedule_with_warmup(optimizer, num_warmup_steps=WARMUP)
    manager = FSDPCheckpointManager(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                    processing_class=tokenizer())
    return model, optimizer, scheduler, manager


def batch(step: int, rank: int):
    import torch
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


def train_step(model, optimizer, scheduler, step: int, rank: int) -> float:
    """One optimizer step: the actor's language-model loss, the critic's (a value model: logits of one label) a
    squared error against per-token returns."""
    import torch
    tokens = batch(step, rank)
    if "TokenClassification" in type(getattr(model, "module", model)).__name__:     # (FSDP1 wraps, FSDP2 subclasses)
        values = model(input_ids=tokens).logits.squeeze(-1)
        returns = (tokens.float() / VOCAB) - 0.5
        loss = torch.nn.functional.mse_loss(values, returns)
    else:
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    return float(loss.detach())


def save_trainer_files(run, steps: int) -> None:
    """What verl's RayPPOTrainer._save_checkpoint writes beside the roles (rank 0, after them): the data loader's
    state in the step folder, then the tracker naming the step."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader
    loader = StatefulDataLoader(list(range(8)), batch_size=2)
    it = iter(loader)
    for _ in range(steps):
        next(it)
    torch.save(loader.state_dict(), os.path.join(run, f"global_step_{steps}", "data.pt"))
    with open(os.path.join(run, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(steps))
