"""The key of a full KV block in the native engine's prefix cache: sha256 over the parent block's key and the
block's token ids (vLLM's ``sha256`` prefix-caching hash has the same chain). Torch-free, so that the gateway's
prefix index (gateway/routing/prefix_index.py) keys its blocks exactly as the engine does."""

from __future__ import annotations

import hashlib
from array import array


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """The prefix-cache key of a full block: sha256 over the parent block's key and this block's token ids."""
    return hashlib.sha256((parent or b"") + array("q", tokens).tobytes()).digest()


def block_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """The chained keys of every full block of ``tokens``, in order."""
    keys: list[bytes] = []
    parent = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start:start + block_size])
        keys.append(parent)
    return keys
