"""The one exception type a person sees: which file, what is wrong."""
from __future__ import annotations


class ReshardError(Exception):
    """A problem reported as one line; the CLI prints it and exits 1."""


class CheckpointError(ReshardError):
    """A file of the checkpoint is unreadable, damaged, hostile or inconsistent."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class UnsafeCheckpointError(CheckpointError):
    """A file asks to run code (a global outside the allow-list). Always fatal, never skipped."""
