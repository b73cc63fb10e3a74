"""The native engine publishes what enters and leaves its prefix cache as vLLM's KV events (vLLM's
--kv-events-config, backends/kv_events.py): ZMQ multipart [topic, seq, msgpack batch], each event a map tagged by
its type with vLLM 0.32's keys, block hashes the engine's own prefix-cache keys. The reader takes vLLM 0.32's maps
and older vLLMs' tagged arrays (real vLLM's events and vllm-router reading ours: tests/peers/test_kv_events.py)."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from backends.base import SamplingParams
from backends.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_events
from backends.native.block_hash import block_hashes
from backends.native.config import EngineConfig, KVEventsConfig
from backends.native.engine import LLMEngine


@pytest.fixture
def engine_and_reader(smollm2_tokenizer):
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", topic="kv")
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=256, block_size=16, num_blocks=6, max_num_seqs=4,
                                    kv_events_config=events), tokenizer=smollm2_tokenizer)
    reader = zmq.Context.instance().socket(zmq.SUB)
    reader.setsockopt_string(zmq.SUBSCRIBE, "kv")
    reader.connect(engine.kv_events.bound)
    time.sleep(0.3)  # a subscriber joins late: give it time before the first message
    yield engine, reader
    reader.close(linger=0)
    engine.close()


def _read(reader, timeout_s: float = 5.0) -> list[tuple[int, list]]:
    """(seq, raw batch) of every message until the socket is quiet."""
    out = []
    while reader.poll(int(timeout_s * 1000)):
        topic, seq, payload = reader.recv_multipart()
        assert topic == b"kv"
        out.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
        timeout_s = 0.5
    return out


def test_stored_blocks_are_published_with_their_tokens_under_the_engines_keys(engine_and_reader):
    engine, reader = engine_and_reader
    prompt = list(range(300, 340))  # 40 tokens: 2 full blocks of 16 once prefilled
    engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    messages = _read(reader)
    seqs = [seq for seq, _ in messages]  # the warm-up's events went out before this reader joined
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # counted up, none missed
    ts, raw_events, rank = messages[0][1]  # vLLM's batch, by position: [ts, events, data_parallel_rank]
    assert isinstance(ts, float) and rank is None
    assert set(raw_events[0]) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                  "medium", "lora_name"} and raw_events[0]["type"] == "BlockStored"
    stored = [e for _, batch in messages for e in decode_events(msgspec.msgpack.encode(batch))]
    first = stored[0]
    assert isinstance(first, BlockStored) and first.parent_block_hash is None and first.block_size == 16
    assert first.block_hashes == block_hashes(prompt, 16)[:2] and first.token_ids == prompt[:32]
    assert first.medium == "CPU"


def test_evicted_blocks_and_a_reset_are_published(engine_and_reader):
    engine, reader = engine_and_reader
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.generate([list(range(100, 164))], params)  # 4 full blocks cached, freed
    engine.generate([list(range(500, 564))], params)  # 6 blocks in all: two of the first prompt's evicted
    engine.blocks.reset_prefix_cache()
    engine.step()  # nothing to run: the reset's event goes out with the step
    events = [e for _, batch in _read(reader) for e in decode_events(msgspec.msgpack.encode(batch))]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed and set(removed) <= set(block_hashes(list(range(100, 164)), 16))
    assert isinstance(events[-1], AllBlocksCleared)


def test_older_vllms_tagged_arrays_are_read_too_and_events_without_their_keys_skipped():
    batch = [1.5, [["BlockStored", [7, 8], None, list(range(32)), 16, None, "GPU"], ["BlockRemoved", [7], "GPU"],
                   ["AllBlocksCleared"], ["SomethingNew", 1], {"type": "BlockStored", "token_ids": [1]}], None]
    assert decode_events(msgspec.msgpack.encode(batch)) == [
        BlockStored([7, 8], None, list(range(32)), 16, None, "GPU", None), BlockRemoved([7], "GPU"),
        AllBlocksCleared()]
