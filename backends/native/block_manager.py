"""Block manager for the paged KV cache, with automatic prefix caching. Never touches tensors.

Blocks are reference counted. A block whose count drops to zero goes to the back of an LRU free
queue but keeps its contents and hash, so a later request with the same prefix can take it back;
it is only forgotten when the queue hands it out again (lazy eviction, as vLLM and nano-vllm do).
Only full blocks are hashed, each key the sha256 of its parent's key and its own tokens, so a hit means
"this whole prefix" with no guard needed against colliding keys (vLLM's ``sha256`` prefix-caching hash).

With ``events`` on, every block that enters the cache (findable by its key) and every one that leaves it is
recorded as vLLM's KV events, for the engine to publish (routers follow them).

Parallel samples of one prompt (``n`` > 1) share its blocks (``fork``). A shared block is never written:
the one step that would write a shared partly filled block first gives the writer its own copy
(copy-on-write), and the model runner copies the block's keys and values before the step
(``take_copies``, carried by the batch).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass

from backends.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from backends.native.block_hash import block_hash
from backends.native.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # chained hash -> block id
        self._copies: list[tuple[int, int]] = []  # (source, destination) block copies for the next step
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        # When a list: what enters and leaves the prefix cache, as vLLM's KV events (backends/kv_events.py), for
        # the engine to publish after each step; ``medium`` names the memory they are in ("GPU" or "CPU").
        self.events: list | None = None
        self.medium = "GPU"

    # ------------------------------------------------------------------------------------ figures
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --------------------------------------------------------------------------------- allocation
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks equal to the sequence's leading full blocks, never covering its last token.

        Pure look-up: pass the result to ``allocate``. Only meaningful for a sequence holding no blocks.
        """
        if not self.enable_prefix_caching or seq.block_table or seq.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed (vLLM skips the cache too)
        tokens = seq.token_ids
        hits, parent = [], None
        for i in range((len(tokens) - 1) // self.block_size):
            h = block_hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
            parent = h
        return hits

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix_hits: Sequence_[int] = ()) -> bool:
        """Give ``seq`` room for ``num_new_tokens`` more tokens after its computed ones and ``prefix_hits``.

        All or nothing: returns False, changing nothing, when the free blocks do not suffice. On success
        the hit blocks are shared and ``seq.num_computed`` moves past them, and a shared block the new
        tokens would be written into is replaced by a copy.
        """
        shared = self._shared_write_block(seq)
        if (not prefix_hits and shared is None
                and seq.num_computed + num_new_tokens <= len(seq.block_table) * self.block_size):
            return True  # room in the blocks it holds: most decode steps
        hit_tokens = len(prefix_hits) * self.block_size
        total = seq.num_computed + hit_tokens + num_new_tokens
        needed = self.blocks_needed(total) - len(seq.block_table) - len(prefix_hits)
        revived = sum(1 for b in prefix_hits if self.blocks[b].ref_count == 0)  # leave the free queue too
        if max(needed, 0) + revived + (shared is not None) > len(self._free):
            return False
        if shared is not None:
            self._copy_on_write(seq, shared)
        if not seq.block_table and self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += hit_tokens
        seq.block_table.extend(self._take_hit(b) for b in prefix_hits)
        seq.num_computed += hit_tokens
        seq.num_hashed_blocks += len(prefix_hits)
        for _ in range(max(needed, 0)):
            seq.block_table.append(self._take_new())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` (holding nothing) the blocks of ``parent``, shared: another sample of its prompt."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.num_hashed_blocks = parent.num_hashed_blocks

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies decided since the last call: the runner does them first."""
        copies, self._copies = self._copies, []
        return copies

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """Position in the table of a shared block holding the next token's slot (a partly filled block of
        a forked prompt), or None. Blocks before it are full and only read; blocks after it are its own."""
        i = seq.num_computed // self.block_size
        if i < len(seq.block_table) and self.blocks[seq.block_table[i]].ref_count > 1:
            return i
        return None

    def _copy_on_write(self, seq: Sequence, i: int) -> None:
        source = seq.block_table[i]
        self.blocks[source].ref_count -= 1  # others still hold it: it stays in use
        seq.block_table[i] = self._take_new()
        self._copies.append((source, seq.block_table[i]))

    def _take_hit(self, block_id: int) -> int:
        """Share a cached block, taking it off the free queue if nobody held it."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1
        return block_id

    def _take_new(self) -> int:
        """The least recently freed block, its old cached contents forgotten."""
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self._cached.get(block.hash) == block_id:
                del self._cached[block.hash]
                if self.events is not None:
                    self.events.append(BlockRemoved([block.hash], self.medium))
            block.hash = None
        block.ref_count = 1
        return block_id

    # ----------------------------------------------------------------------------- prefix caching
    def register_full_blocks(self, seq: Sequence) -> None:
        """Hash and publish the blocks of ``seq`` that are now full of computed tokens."""
        full = seq.num_computed // self.block_size
        if not self.enable_prefix_caching or full <= seq.num_hashed_blocks:
            return
        parent = self.blocks[seq.block_table[seq.num_hashed_blocks - 1]].hash if seq.num_hashed_blocks else None
        stored = None  # the event of a run of newly cached blocks
        for i in range(seq.num_hashed_blocks, full):
            block = self.blocks[seq.block_table[i]]
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            h = block_hash(parent, tokens)
            block.hash = h
            if self._cached.setdefault(h, block.block_id) != block.block_id:  # an equal block cached earlier
                stored = None  # stays canonical: nothing new is cached
            elif self.events is not None:
                if stored is None:
                    stored = BlockStored([], parent, [], self.block_size, None, self.medium, None)
                    self.events.append(stored)
                stored.block_hashes.append(h)
                stored.token_ids.extend(tokens)
            parent = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block and the hit counters (vLLM's ``reset_prefix_cache``); no block may be held."""
        assert self.num_free_blocks == self.num_blocks, "blocks are still held"
        self._cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        for block in self.blocks:
            block.hash = None
        self.prefix_queries = self.prefix_hits = 0

    # ------------------------------------------------------------------------------------ release
    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``; tail blocks first, so they are evicted first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.hash is None or self._cached.get(block.hash) != block_id:
                    block.hash = None  # not findable: nothing to keep
                self._free[block_id] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.num_computed = 0
