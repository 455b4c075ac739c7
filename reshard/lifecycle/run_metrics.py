"""The metrics a framework records with its checkpoints, and a user's metrics file.

- Hugging Face Trainer: `trainer_state.json` in each `checkpoint-N/`: `log_history` (one record per logging or
  evaluation, with its `step`), `best_metric`, `best_model_checkpoint`.
- Lightning: the ModelCheckpoint callback's state in the checkpoint's `callbacks` (the `.ckpt` file, or the client
  state of a DeepSpeed `.ckpt/` folder): `monitor`, `current_score` (the monitored value at this save),
  `best_model_path`. Scores are tensors: read as one scalar each, through the safe reader's references.
- DeepSpeed: numbers the training script passed to `save_checkpoint(client_state=...)`.
- A metrics file (`--metrics FILE`): JSON `{"STEP": VALUE}`, `{"NAME": {"STEP": VALUE}}` or
  `[{"step": STEP, "NAME": VALUE, ...}]`, or CSV with a `step` column and one column per metric.
"""
from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass, field

from reshard.core.catalog import ScalarTensor
from reshard.errors import ReshardError
from reshard.formats.deepspeed.notes import DeepSpeedNotes
from reshard.formats.hf.trainer import TRAINER_STATE
from reshard.formats.single.notes import SingleNotes
from reshard.formats.torchsave_read import TensorRef
from reshard.storage import files as fs

CALLBACKS = "callbacks"
MODEL_CHECKPOINT = "ModelCheckpoint"
# fields of a log record or a client state that count rather than measure
NOT_METRICS = {"step", "epoch", "total_flos", "global_step", "global_steps", "global_samples", "iteration",
               "skipped_steps"}
TIMINGS = ("_runtime", "_per_second")   # how fast an evaluation ran, not how good the checkpoint is


@dataclass(frozen=True)
class Recorded:
    """What one checkpoint records: its own metrics, the run's log it carries, the checkpoint it calls best."""
    metrics: dict = field(default_factory=dict)     # {name: value} at this checkpoint's step
    history: dict = field(default_factory=dict)     # {step: {name: value}} (Hugging Face's log_history)
    best: str | None = None                         # path of the best checkpoint, as the framework saved it
    best_by: str = ""                               # where that was read ("trainer_state.json best_model_checkpoint")


def recorded(path: str, step: int | None, catalog) -> Recorded:
    """The metrics of the checkpoint at `path` (its catalog: None when it could not be read)."""
    state_file = os.path.join(path, TRAINER_STATE)
    if fs.isdir(path) and fs.isfile(state_file):
        return _trainer_state(state_file, step)
    if catalog is None:
        return Recorded()
    notes = catalog.notes
    extra = notes.lightning if isinstance(notes, SingleNotes) else \
        notes.client_state if isinstance(notes, DeepSpeedNotes) else {}
    callbacks = extra.get(CALLBACKS)
    if isinstance(callbacks, dict):
        for key, state in callbacks.items():
            if str(key).startswith(MODEL_CHECKPOINT) and isinstance(state, dict):
                return _model_checkpoint(state, path)
    if isinstance(notes, DeepSpeedNotes):
        return Recorded({k: v for k, v in ((k, _number(v)) for k, v in extra.items() if k not in NOT_METRICS)
                         if v is not None})
    return Recorded()


def _trainer_state(state_file: str, step: int | None) -> Recorded:
    try:
        with fs.open(state_file) as f:
            state = json.load(f)
        history: dict[int, dict[str, float]] = {}
        for record in state.get("log_history") or []:
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                values = {k: float(v) for k, v in record.items() if k not in NOT_METRICS
                          and not k.endswith(TIMINGS) and isinstance(v, (int, float)) and not isinstance(v, bool)}
                history.setdefault(record["step"], {}).update(values)
        at = state.get("global_step") if isinstance(state.get("global_step"), int) else step
    except (OSError, ValueError, AttributeError) as e:
        raise ReshardError.at(state_file, f"unreadable ({e})") from None
    best = state.get("best_model_checkpoint")
    return Recorded(history.get(at, {}) if at is not None else {}, history, best if isinstance(best, str) else None,
                    f"{TRAINER_STATE} best_model_checkpoint")


def _model_checkpoint(state: dict, path: str) -> Recorded:
    monitor, score = state.get("monitor"), _number(state.get("current_score"))
    metrics = {monitor: score} if isinstance(monitor, str) and score is not None else {}
    best = state.get("best_model_path")
    return Recorded(metrics, {}, best or None if isinstance(best, str) else None, "ModelCheckpoint best_model_path")


def _number(value) -> float | None:
    """A finite metric value from plain data, a one-element tensor or a scalar stand-in; None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, TensorRef):
        if value.numel != 1:
            return None
        from reshard.reading.source_bytes import read_scalar
        try:
            value = read_scalar(value)
        except ReshardError:
            return None
    if isinstance(value, ScalarTensor):
        value = value.value
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def read_metrics_file(path: str, name: str | None) -> dict:
    """{step: {metric: value}} from a user's metrics file; `name` names the values of a bare {step: value} file."""
    try:
        with fs.open(path, newline="") as f:
            text = f.read()
    except OSError as e:
        raise ReshardError.at(path, f"cannot read ({e.strerror})") from None
    try:
        if path.endswith(".csv"):
            return _merge(_csv_rows(text))
        data = json.loads(text)
        if isinstance(data, list):
            return _merge(data)
        if isinstance(data, dict) and all(isinstance(v, dict) for v in data.values()):
            return _merge({"step": s, metric: v} for metric, by_step in data.items() for s, v in by_step.items())
        if isinstance(data, dict):
            return _merge({"step": s, name or "metric": v} for s, v in data.items())
    except (ValueError, TypeError, KeyError) as e:
        raise ReshardError.at(path, f"not a metrics file (JSON or CSV of step -> value: {e})") from None
    raise ReshardError.at(path, "not a metrics file (JSON or CSV of step -> value)")


def _csv_rows(text: str):
    rows = list(csv.DictReader(text.splitlines()))
    if not rows or "step" not in rows[0]:
        raise ValueError("no 'step' column")
    return [{k: v for k, v in row.items() if v not in ("", None)} for row in rows]


def _merge(records) -> dict:
    out: dict[int, dict[str, float]] = {}
    for record in records:
        step = int(record["step"])
        values = {k: float(v) for k, v in record.items() if k != "step"}
        out.setdefault(step, {}).update(values)
    return out
