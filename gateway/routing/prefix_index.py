"""What each deployment holds in its prefix cache, as chained block keys, bounded and LRU-evicted.

A key is the native engine's block key (backends/native/block_hash.py: sha256 over the parent's key and the
block's token ids), computed by the gateway from the tokens of a request, so a lookup is "how many leading full
blocks of this prompt does that engine hold". Two ways fill it:
- approximately, from this gateway's own decisions (``record``): the blocks a prompt fills on the deployment it
  was sent to; they may have been evicted since, and other gateways' requests are not seen;
- precisely, from the engine's KV events (``stored`` / ``removed`` / ``cleared``, vLLM's BlockStored,
  BlockRemoved, AllBlocksCleared): the engine names its blocks by its own hashes (vLLM's differ from ours), so
  the index keeps, per deployment, the engine's hash -> our key, our key rebuilt from the event's token ids
  under its parent's. A stored block whose parent the index never saw cannot be keyed and is skipped.
"""

from __future__ import annotations

from collections import OrderedDict

from backends.native.block_hash import block_hash


class PrefixIndex:
    def __init__(self, capacity_blocks: int) -> None:
        """At most ``capacity_blocks`` keys per deployment; the least recently used go first."""
        self.capacity = capacity_blocks
        self._keys: dict[str, OrderedDict[bytes, None]] = {}
        self._engine_keys: dict[str, dict[object, bytes]] = {}  # per deployment: the engine's hash -> our key

    def match(self, deployment: str, keys: list[bytes]) -> int:
        """How many leading blocks of ``keys`` ``deployment`` holds (the matched ones become most recent)."""
        held = self._keys.get(deployment)
        if not held:
            return 0
        n = 0
        for key in keys:
            if key not in held:
                break
            held.move_to_end(key)
            n += 1
        return n

    def record(self, deployment: str, keys: list[bytes]) -> None:
        """``deployment`` now holds ``keys`` (a prompt's full blocks it was sent with)."""
        held = self._keys.setdefault(deployment, OrderedDict())
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def stored(self, deployment: str, engine_hashes: list, parent: object, token_ids: list[int],
               block_size: int) -> None:
        """The engine stored blocks ``engine_hashes`` (its names for them), holding ``token_ids`` in order, after
        the block it calls ``parent`` (None: the first blocks of a prompt)."""
        names = self._engine_keys.setdefault(deployment, {})
        key = None if parent is None else names.get(parent)
        if parent is not None and key is None:
            return  # its prefix is unknown here: the blocks cannot be keyed
        keys = []
        for i, engine_hash in enumerate(engine_hashes):
            tokens = token_ids[i * block_size:(i + 1) * block_size]
            if len(tokens) < block_size:
                break
            key = block_hash(key, tokens)
            names[engine_hash] = key
            keys.append(key)
        self.record(deployment, keys)

    def removed(self, deployment: str, engine_hashes: list) -> None:
        """The engine evicted these blocks."""
        names = self._engine_keys.get(deployment, {})
        held = self._keys.get(deployment) or OrderedDict()
        for engine_hash in engine_hashes:
            key = names.pop(engine_hash, None)
            if key is not None:
                held.pop(key, None)

    def cleared(self, deployment: str) -> None:
        """The engine dropped every block (a restart, or its prefix cache reset), or it left the fleet."""
        self._keys.pop(deployment, None)
        self._engine_keys.pop(deployment, None)

    def size(self, deployment: str) -> int:
        return len(self._keys.get(deployment, ()))
