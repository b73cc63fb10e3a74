"""The routing index (gateway/routing/prefix_index.py) keys blocks as the native engine's prefix cache does, stays
within its bounds, and follows an engine's KV events whatever the engine names its blocks."""

from __future__ import annotations

from backends.base import SamplingParams
from backends.native.block_hash import block_hashes
from backends.native.block_manager import BlockManager
from backends.native.sequence import Sequence
from gateway.routing.prefix_index import PrefixIndex


def test_block_keys_are_the_engines_own_prefix_cache_keys():
    tokens = list(range(100, 170))  # 4 full blocks of 16 and 6 more
    blocks = BlockManager(num_blocks=16, block_size=16)
    seq = Sequence("r", tokens, SamplingParams())
    assert blocks.allocate(seq, len(tokens))
    seq.num_computed = len(tokens)
    blocks.register_full_blocks(seq)
    assert block_hashes(tokens, 16) == [blocks.blocks[i].hash for i in seq.block_table[:4]]


def test_matches_count_leading_blocks_and_the_least_recently_used_go_first():
    index = PrefixIndex(capacity_blocks=4)
    a, b = block_hashes(list(range(64)), 16), block_hashes(list(range(1000, 1064)), 16)
    index.record("d", a)
    assert index.match("d", a) == 4 and index.match("d", a[:2] + b[2:]) == 2 and index.match("e", a) == 0
    index.record("d", b[:2])  # over capacity: a's two least recently used blocks go
    assert index.size("d") == 4 and index.match("d", a) == 2 and index.match("d", b) == 2  # a[:2] were just used


def test_kv_events_are_followed_under_the_engines_own_names_for_its_blocks():
    index = PrefixIndex(capacity_blocks=100)
    tokens = list(range(48))
    keys = block_hashes(tokens, 16)
    index.stored("d", [7001, 7002], None, tokens[:32], 16)  # vLLM names its blocks by its own hashes
    index.stored("d", [7003], 7002, tokens[32:48], 16)  # a later event, chained on the parent's name
    assert index.match("d", keys) == 3
    index.stored("d", [9001], 4242, list(range(16)), 16)  # a parent never seen: cannot be keyed
    assert index.size("d") == 3
    index.removed("d", [7002])
    assert index.match("d", keys) == 1
    index.cleared("d")
    assert index.match("d", keys) == 0
