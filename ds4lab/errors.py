"""ds4lab's own error types: every bad input ends in one of these, with a message naming the file."""

from __future__ import annotations


class Ds4labError(Exception):
    """Base class of every error ds4lab raises on bad input."""


class FileFormatError(Ds4labError, ValueError):
    """A file that breaks its format: each problem names the field, what was expected and
    what was found, and where known the byte offset."""

    def __init__(self, path: str, problems: list[str] | str, offset: int | None = None) -> None:
        self.path = str(path)
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.offset = offset
        where = f"{self.path}" + (f" (at byte offset {offset})" if offset is not None else "")
        if len(self.problems) == 1:
            text = f"{where}: {self.problems[0]}"
        else:
            text = f"{where}: {len(self.problems)} problems\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(text)


class ModelFileError(FileFormatError):
    """A GGUF file that is not a valid ds4 model (a key, a tensor, the container)."""


class KVCFormatError(FileFormatError):
    """A ds4 disk-cache (.kv) file that cannot be read: header, text, payload or trailer."""
