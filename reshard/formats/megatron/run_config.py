"""What megatron-core derives from a run's configuration rather than from its tensors, derived again for a target:
the grad buffers' dtypes (which name the distributed optimizer's dp_reshardable keys) and the vocabulary's padding
(which sizes the embedding and the output layer).

A save written with the source's values where the target run builds others does not load: Megatron asks for
`...dtype_(torch.bfloat16, torch.float32).bucket_idx_0.param` by the dtypes of the buffers it built, and for an
embedding of the rows it padded its tokenizer's vocabulary to. docs/formats/megatron.md lists every such key.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reshard.core.placement import Index, Shard
from reshard.core.write_requests import Piece
from reshard.errors import CheckpointError, ReshardError, UsageError

TORCH_DTYPES = {"bfloat16": "torch.bfloat16", "float16": "torch.float16", "float32": "torch.float32"}
# Megatron-LM's arguments that choose the dtype gradients are reduced in, in the order it reads them:
# accumulate_allreduce_grads_in_fp32 (its own; DistributedDataParallelConfig.grad_reduce_in_fp32 is set from it)
# and grad_reduce_in_fp32 (the DDP config's name, which a run driving megatron-core itself records)
GRAD_ARGS = ("accumulate_allreduce_grads_in_fp32", "grad_reduce_in_fp32")


def grad_buffer(args: Mapping[str, Any], model_dtype: str, saved: Sequence[tuple[str, str]],
                where: str) -> tuple[str, str]:
    """(param dtype, grad dtype), torch's names, of the grad buffer the target run builds: the source's where its
    buffers are saved (`saved`, from a dp_reshardable source), checked against `args`; else what `args` make of it
    as Megatron-LM does (megatron-core's DDP: grads in fp32 where grad_reduce_in_fp32, else in the params' dtype;
    Megatron-LM's validate_args turns accumulate_allreduce_grads_in_fp32 on for every bf16 run unless
    grad_reduce_in_bf16). A contradiction is refused naming the argument and `where` (the save)."""
    param = TORCH_DTYPES.get(model_dtype)
    if param is None:
        raise ReshardError.at(where, f"params of {model_dtype}: megatron-core's grad buffers hold bf16, fp16 or fp32")
    named = next(((key, args[key]) for key in GRAD_ARGS if isinstance(args.get(key), bool)), None)
    if model_dtype == "float32":
        grad = param            # (fp32 params keep fp32 grads whatever the flag)
    elif named is not None:
        grad = TORCH_DTYPES["float32"] if named[1] else param
    else:
        grad = TORCH_DTYPES["float32"] if model_dtype == "bfloat16" and not args.get("grad_reduce_in_bf16") else param
    if not saved:
        return param, grad
    if len(set(saved)) != 1:
        raise ReshardError.at(where, f"grad buffers of several dtypes ({', '.join(map(str, sorted(set(saved))))}): "
                              "a buffer per dtype is not written yet")
    kept = saved[0]
    if kept[0] != param:
        raise CheckpointError(where, f"its grad buffer is keyed {kept}, its params are {param}")
    if named is not None and model_dtype != "float32" and kept[1] != grad:
        raise ReshardError.at(where, f"args.{named[0]} = {named[1]}: gradients reduced in {grad}, but the saved "
                              f"grad buffers are {kept} ({kept[1]} gradients); the run's arguments and its save "
                              "disagree")
    return kept


@dataclass(frozen=True)
class Vocabulary:
    """The rows of the vocabulary-sized tensors (the word embeddings, the output layer): as saved, at the target,
    and the tokenizer's vocabulary below the padding where known."""
    saved: int
    rows: int
    tokens: int | None = None

    @property
    def repadded(self) -> bool:
        return self.rows != self.saved


def _padded(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


def vocabulary(args: Mapping[str, Any], saved: int, source_tp: int, target_tp: int, given: int | None,
               where: str) -> Vocabulary:
    """The target's padded vocabulary, as Megatron-LM pads it when it builds the model at `target_tp` (its
    build_tokenizer: the tokenizer's vocabulary up to a multiple of make_vocab_size_divisible_by x tp). The
    tokenizer's size is `given` (vocab=N), args.vocab_size, or, where neither says it, whatever the `saved` padding
    at `source_tp` allows: every size it allows must pad alike at the target (a tp that multiplies the source's
    always does; a smaller one may need the size). A run whose args name no make_vocab_size_divisible_by keeps the
    saved rows."""
    known = args.get("vocab_size") if type(args.get("vocab_size")) is int else None
    if given is not None and known is not None and given != known:
        raise UsageError(f"vocab={given}: the save's args.vocab_size is {known}")
    tokens = given if given is not None else known
    if tokens is not None and tokens > saved:
        raise ReshardError.at(where, f"a vocabulary of {tokens} tokens does not fit the {saved} embedding rows saved")
    divisor = args.get("make_vocab_size_divisible_by")
    if type(divisor) is not int or divisor < 1:
        if saved % target_tp:
            raise ReshardError(f"target tp={target_tp}: {saved} vocabulary rows do not split evenly, and the save's "
                               "args name no make_vocab_size_divisible_by to pad them by")
        return Vocabulary(saved, saved, tokens)
    multiple = divisor * target_tp
    if tokens is not None:
        return Vocabulary(saved, _padded(tokens, multiple), tokens)
    own = divisor * source_tp
    fewest = saved - own + 1 if saved % own == 0 else None       # the smallest vocabulary padded to `saved`
    if fewest is None or _padded(fewest, multiple) != _padded(saved, multiple):
        raise ReshardError.at(where, f"target tp={target_tp}: Megatron-LM pads the tokenizer's vocabulary to a "
                              f"multiple of make_vocab_size_divisible_by x tp = {multiple}, which for the {saved} rows "
                              "saved depends on the vocabulary's own size: give it, --to ...,vocab=N")
    return Vocabulary(saved, _padded(saved, multiple))


def repadded_pieces(source: tuple[str, str], saved: Index, shard: Shard, start: int, count: int) -> list[Piece]:
    """The pieces of elements [start, start + count) of `shard`, whole rows of a vocabulary-sized tensor padded to
    another size than `saved`: the rows the save holds taken from it, every row past them a copy of its last row —
    what Megatron-LM's own tools/checkpoint writes into added rows (saver_base.py's pad_weight: the last entry
    replicated; rows past the new padding cut), here for the masters and both moments too, so an added row is the
    last one in every state and trains as it would."""
    (block,) = shard.blocks
    width = math.prod(saved[1:])
    if tuple(block.shape[1:]) != tuple(saved[1:]) or any(block.at[1:]):
        raise AssertionError(f"{source[0]}: a vocabulary-padded tensor is cut into whole rows")
    held = max(0, min(block.shape[0], saved[0] - block.at[0])) * width    # elements of `shard` the save holds
    pieces = []
    at, end = start, start + count
    if at < held:
        take = min(end, held) - at
        pieces.append(Piece(take, source, at, shard=Shard.box(block.at, (held // width, *saved[1:]))))
        at += take
    last = Shard.box((saved[0] - 1, *(0 for _ in saved[1:])), (1, *saved[1:]))
    while at < end:
        column = (at - held) % width
        take = min(end - at, width - column)
        pieces.append(Piece(take, source, column, shard=last))
        at += take
    return pieces
