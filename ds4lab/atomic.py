"""Atomic file writes: a temp file beside the target, fsync, then rename over it.

A write that fails half way leaves the user's previous file untouched and no temp file
behind. `private=True` creates the file 0600 (and a missing directory 0700), for files
that hold prompts verbatim.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


@contextmanager
def atomic_open(path: str | os.PathLike[str], private: bool = False) -> Iterator[BinaryIO]:
    """A binary file to write `path` through; it replaces `path` only when the block ends cleanly."""
    path = Path(path)
    if private:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o666)
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
