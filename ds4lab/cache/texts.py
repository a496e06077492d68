"""Rendered texts as positions in a tree, so the simulator never hashes or copies prompts.

ds4 names a checkpoint by the SHA-1 of its rendered bytes and finds one by hashing prompt
prefixes. A trace of 100k requests with 50k-token prompts is far too much text for that, and
the only question ever asked is "is this text a byte prefix of that one?". So each text is a
branch of a tree plus a length: a branch shares its parent's first `fork` bytes and is unique
after them. Two texts share exactly the bytes up to where their branches part, so prefix
tests and canonical names (the stand-in for the SHA-1) cost a walk up a few branches.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

# Real texts are indexed by the hash of every 256-byte prefix; a new text forks from the
# stored text it shares the most blocks with, refined byte by byte inside the next block.
_BLOCK = 256


class Text(NamedTuple):
    """The first `nbytes` bytes of branch `branch`, which render `tokens` tokens."""

    branch: int
    nbytes: int
    tokens: int


class TextTree:
    """Branches of texts; `key(text)` plays the role of the SHA-1 file name."""

    def __init__(self) -> None:
        self.parent: list[int] = []
        self.fork: list[int] = []
        self._data: dict[int, bytes] = {}
        self._blocks: dict[bytes, list[int]] = {}

    def new_branch(self, parent: int = -1, fork: int = 0) -> int:
        """A branch equal to `parent`'s first `fork` bytes, then bytes no other branch has."""
        self.parent.append(parent)
        self.fork.append(fork if parent >= 0 else 0)
        return len(self.parent) - 1

    def owner(self, branch: int, nbytes: int) -> int:
        """The branch nearest the root whose first `nbytes` bytes equal `branch`'s."""
        parent, fork = self.parent, self.fork
        while parent[branch] >= 0 and nbytes <= fork[branch]:
            branch = parent[branch]
        return branch

    def key(self, text: Text) -> tuple[int, int]:
        """A name equal for equal texts and different otherwise."""
        return self.owner(text.branch, text.nbytes), text.nbytes

    def is_prefix(self, prefix: Text, text: Text) -> bool:
        """Whether `prefix`'s bytes are the first bytes of `text`."""
        return prefix.nbytes <= text.nbytes and \
            self.owner(text.branch, prefix.nbytes) == self.owner(prefix.branch, prefix.nbytes)

    @staticmethod
    def cut(text: Text, tokens: int) -> Text:
        """The first `tokens` tokens of `text`, bytes in proportion (exact for a fixed
        bytes-per-token ratio, the synthetic traces' case)."""
        if tokens == text.tokens:
            return text
        return Text(text.branch, tokens * text.nbytes // text.tokens if text.tokens else 0, tokens)

    def add_bytes(self, data: bytes) -> int:
        """A branch whose first len(data) bytes are `data`, forked from the stored text that
        shares the longest prefix with it."""
        digest = hashlib.sha1()
        shared, candidates = 0, []
        for start in range(0, len(data) - _BLOCK + 1, _BLOCK):
            digest.update(data[start:start + _BLOCK])
            found = self._blocks.get(digest.digest())
            if found is None:
                break
            shared, candidates = start + _BLOCK, found
        if not shared:
            candidates = list(self._data)  # no whole block in common with any text: compare the first bytes
        best, lcp = -1, 0
        for cand in candidates:
            common = shared + _common_len(data[shared:shared + _BLOCK], self._data[cand][shared:shared + _BLOCK])
            if best < 0 or common > lcp:
                best, lcp = cand, common
        if best >= 0 and lcp == 0:
            best = -1
        if best >= 0 and lcp == len(data):
            return best
        branch = self.new_branch(best, lcp)
        self._data[branch] = data
        digest = hashlib.sha1()
        for start in range(0, len(data) - _BLOCK + 1, _BLOCK):
            digest.update(data[start:start + _BLOCK])
            self._blocks.setdefault(digest.digest(), []).append(branch)
        return branch


def _common_len(a: bytes, b: bytes) -> int:
    """Length of the common prefix of two short byte strings."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
