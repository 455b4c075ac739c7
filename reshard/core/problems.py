"""What is wrong with a checkpoint, typed: which file, which tensor, what kind of problem, and the words for people."""
from __future__ import annotations

from dataclasses import dataclass

from reshard.errors import ReshardError

# Kinds of problem (Problem.kind): where they come from, so a caller can tell them apart without reading words.
READER = "reader"               # what a reader noticed opening the files (missing, unreadable, disagreeing)
MISSING = "missing"             # elements of a tensor no fragment holds
DUPLICATE = "duplicate"         # elements more than one fragment holds
OUTSIDE = "outside"             # a fragment beyond its tensor or its storage
NO_STATE = "no_state"           # a trainable parameter without its master copy or an optimizer state
NON_FINITE = "non_finite"       # NaN/Inf values (--deep)
CHECKSUM = "checksum"           # bytes that do not match their CRC-32 or the manifest (--deep, --checksums)
REPLICA = "replica"             # a replicated tensor whose copies differ (--deep)


@dataclass(frozen=True)
class Problem:
    file: str | None        # the file (or the checkpoint's root) it is in; None where a line names none
    tensor: str | None      # the logical tensor, "name (state)", where one is concerned
    kind: str               # one of the kinds above
    message: str            # the words after the file

    @classmethod
    def of_error(cls, error: ReshardError, kind: str = READER, tensor: str | None = None) -> Problem:
        """What a ReshardError says, as a problem: its file, and its line after the file."""
        line = str(error)
        if error.file is not None and line.startswith(error.file + ": "):
            return cls(error.file, tensor, kind, line[len(error.file) + 2:])
        return cls(None, tensor, kind, line)

    @classmethod
    def from_line(cls, line: str, root: str = "", kind: str = READER, tensor: str | None = None) -> Problem:
        """A problem given as one line, `path: text` (readers' and the manifest's, errors raised while reading):
        the path is its file where the line starts with one (a path, or the checkpoint's `root`)."""
        file, sep, message = line.partition(": ")
        if sep and ("/" in file or (root and file.startswith(root))):
            return cls(file, tensor, kind, message)
        return cls(None, tensor, kind, line)

    def __str__(self) -> str:
        """The line printed by `reshard validate`: `file: message`."""
        return self.message if self.file is None else f"{self.file}: {self.message}"

    def __contains__(self, text: str) -> bool:
        """Words searched in its line, as in the string a problem was before it had a type."""
        return text in str(self)
