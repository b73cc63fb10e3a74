"""Trace replay: Mooncake's JSONL and a plain one, read strictly; shared hash ids become exactly shared prompt
blocks, as long as the target counts them; requests go at the trace's times (scaled), a session's in order."""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

import pytest

from loadtest.client import RequestOptions, Target
from loadtest.mock_server import create_mock_app
from loadtest.runner import RunConfig
from loadtest.schedule import Schedule
from loadtest.session import Session, Workload, run_session
from loadtest.trace import read_trace, trace_specs
from loadtest.workload import LocalCounter, fit, load_tokenizer
from tests.servers import serve_app

MOONCAKE = [  # the first lines of Mooncake's conversation trace shape, block size 4 to stay small
    {"timestamp": 1000, "input_length": 10, "output_length": 3, "hash_ids": [0, 1, 2]},
    {"timestamp": 1500, "input_length": 12, "output_length": 2, "hash_ids": [0, 1, 3]},
    {"timestamp": 1250, "input_length": 5, "output_length": 4, "hash_ids": [4, 5]},
]


def _write(tmp_path: Path, rows: list, name: str = "trace.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def read_trace_rows(rows: list[dict], block_size: int = 4):
    with tempfile.TemporaryDirectory() as folder:
        return read_trace(_write(Path(folder), rows), block_size)


def test_a_mooncake_trace_is_read_in_time_order_from_its_first_request(tmp_path):
    trace = read_trace(_write(tmp_path, MOONCAKE), block_size=4)
    assert [r.at_s for r in trace] == [0.0, 0.25, 0.5]
    assert [r.input_length for r in trace] == [10, 5, 12] and trace[2].hash_ids == (0, 1, 3)


@pytest.mark.parametrize("line, words", [
    ({"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [0, 1]}, ["line 1", "2 hash_ids", "4-token"]),
    ({"timestamp": 0, "input_length": 10}, ["output_length"]),
    ({"timestamp": -5, "input_length": 10, "output_length": 3}, ["timestamp"]),
    ({"timestamp": 0, "input_length": 4, "output_length": 3, "priority": 1}, ["priority"]),
    ({"timestamp": 0, "prompt": "hi", "input_length": 4, "output_length": 3}, ["prompt"]),
    ("not json", ["line 1"]),
])
def test_a_bad_line_is_refused_naming_it(tmp_path, line, words):
    with pytest.raises(ValueError) as error:
        read_trace(_write(tmp_path, [line]), block_size=4)
    assert all(w in str(error.value) for w in words), error.value


def test_prompts_and_lengths_do_not_mix_in_one_trace(tmp_path):
    rows = [{"timestamp": 0, "prompt": "hi", "output_length": 1}, {"timestamp": 1, "input_length": 3, "output_length": 1}]
    with pytest.raises(ValueError, match="not a mix"):
        read_trace(_write(tmp_path, rows))


def test_equal_hash_ids_are_equal_blocks_and_lengths_are_exact():
    tokenizer = load_tokenizer(None)
    trace = read_trace_rows(MOONCAKE)
    specs = trace_specs(trace, tokenizer, 4, seed=7)
    ids = [tokenizer.encode(s.prompt, add_special_tokens=False) for s in specs]
    assert [len(i) for i in ids] == [10, 5, 12] == [s.prompt_tokens for s in specs]
    assert ids[0][:8] == ids[2][:8] and ids[0][8:12] != ids[2][8:12]  # blocks 0 and 1 shared, 2 and 3 not
    assert ids[1][:4] != ids[0][:4]  # hash ids 4 and 5 are blocks of their own
    # another point's prompts share nothing with this one's (salted), but share within themselves again
    other = [tokenizer.encode(s.prompt, add_special_tokens=False) for s in trace_specs(trace, tokenizer, 4, seed=8)]
    assert other[0][:4] != ids[0][:4] and other[0][:8] == other[2][:8]


def test_time_scale_multiplies_the_send_times():
    specs = trace_specs(read_trace_rows(MOONCAKE), load_tokenizer(None), 4, seed=0, time_scale=0.5)
    assert [s.at_s for s in specs] == [0.0, 0.125, 0.25]


def test_fitting_to_a_chat_template_trims_the_end_and_keeps_the_shared_blocks():
    tokenizer = load_tokenizer(None)
    rows = [{"timestamp": 0, "input_length": 64, "output_length": 1, "hash_ids": [0, 1]},
            {"timestamp": 1, "input_length": 64, "output_length": 1, "hash_ids": [0, 2]}]
    specs = trace_specs(read_trace_rows(rows, 32), tokenizer, 32, seed=0)
    counter = LocalCounter(tokenizer, True, "local")
    fitted = asyncio.run(fit(specs, counter))
    assert [len(tokenizer.apply_chat_template([{"role": "user", "content": s.prompt}])) for s in fitted] == [64, 64]
    first, second = (tokenizer.encode(s.prompt, add_special_tokens=False) for s in fitted)
    assert first[:32] == second[:32] and first[32:] != second[32:]


def test_a_replay_sends_at_the_trace_times_and_a_sessions_requests_in_turn(tmp_path):
    rows = [{"timestamp": 0, "input_length": 20, "output_length": 4, "session_id": "a"},
            {"timestamp": 10, "input_length": 30, "output_length": 4, "session_id": "a"},  # due before "a" ends
            {"timestamp": 100, "input_length": 25, "output_length": 4},
            {"timestamp": 300, "input_length": 40, "output_length": 4, "session_id": "b"}]
    path = _write(tmp_path, rows)
    workload = Workload(0, 1, 1, trace=path, trace_block_size=16)
    point = RunConfig(schedule=Schedule.trace, request=RequestOptions(ignore_eos=True))
    with serve_app(create_mock_app("m", ttft_s=0.05, itl_s=0.02)) as url:
        (result,) = asyncio.run(run_session(Session([Target(url, "m")], workload, [point], warmup=0, seed=1)))
    records = sorted(result.records, key=lambda r: r.index)
    t0 = min(r.target_send for r in records)
    assert [round(r.target_send - t0, 3) for r in records[2:]] == [0.1, 0.3]  # independent: at their times
    assert records[1].actual_send >= records[0].end  # a session's next request waits for the previous answer
    assert [r.prompt_tokens for r in records] == [20, 30, 25, 40]  # as the server counted them
    assert result.summary["completed"] == 4 and result.summary["workload"].startswith("trace=trace.jsonl n=4")


def test_a_trace_with_sessions_refuses_worker_processes(tmp_path):
    # a session's request waits for the answer before it, which only the process that sent that one holds
    from typer.testing import CliRunner

    from gateway.cli import app as cli

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 8, "output_length": 2,
                                         "session_id": i % 2}) + "\n" for i in range(4)))
    out = CliRunner().invoke(cli, ["loadtest", "run", "--target", "http://127.0.0.1:9#m", "--trace", str(trace),
                                   "--workers", "2"], env={"COLUMNS": "300"})
    assert out.exit_code == 2 and "one client process" in out.output, out.output
