"""The one exception type a person sees: which file, what is wrong."""
from __future__ import annotations


class ReshardError(Exception):
    """A problem reported as one line; the CLI prints it and exits 1.

    `file` is the file or folder the problem is about, when there is one (the line then starts with
    it): `--json` reports it as a field, so a program need not cut it out of the text.
    """

    def __init__(self, message: str, file=None):
        super().__init__(message)
        self.file = None if file is None else str(file)

    @classmethod
    def at(cls, file, problem: str):
        """The usual line, `FILE: problem`, with `file` set."""
        return cls(f"{file}: {problem}", file=file)


class UsageError(ReshardError):
    """The command asks for something that cannot apply (an option the source's format takes no
    use of, an output name contradicting --format): the CLI exits 2, as for a bad argument."""


class UnknownFormatError(ReshardError):
    """No reader recognises the path as a checkpoint."""


class CheckpointError(ReshardError):
    """A file of the checkpoint is unreadable, damaged, hostile or inconsistent."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}", file=self.path)     # as ReshardError.at


class UnsafeCheckpointError(CheckpointError):
    """A file asks to run code (a global outside the allow-list). Always fatal, never skipped."""


class UnprovenMappingError(CheckpointError):
    """The files read, but which parameter an optimizer entry belongs to cannot be proven (entries and parameters of
    equal shapes in a file that keeps no parameter order): no proof that anything is missing, only that reshard
    cannot tell."""


class UnreadLayoutError(CheckpointError):
    """A framework's layout recognised but not read (verl's schema 1 Megatron layout, its model saved through a
    bridge): no proof that anything is missing, only that reshard does not read it."""
