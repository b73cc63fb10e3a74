"""Multi-turn conversations (loadtest/workload.py ``conversations``, the runner's ``_converse``): every turn carries
the system prompt and the whole history, the model's answers included; a server that keeps the history's KV
cache serves it from there, which the results show per request (cached tokens) and over the run (the server's
own prefix-cache counters)."""

from __future__ import annotations

import asyncio

from typer.testing import CliRunner

from gateway.cli import app as cli
from loadtest.client import RequestOptions, Target
from loadtest.runner import RunConfig, run_target
from loadtest.session import Workload
from loadtest.workload import conversations, load_tokenizer
from tests.conftest import MODEL


def test_each_turn_carries_the_history_and_the_server_serves_it_from_its_cache(start_gateway, engine_idle):
    tokenizer = load_tokenizer(None)
    specs = conversations(tokenizer, users=3, turns=3, system_len=80, question_len=12, output_len=6, seed=1)
    assert len({s.system for s in specs}) == 1 and [s.conversation for s in specs] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    with start_gateway() as (url, _):
        result = asyncio.run(run_target(Target(url, MODEL), specs, RunConfig(
            request=RequestOptions(endpoint="chat", temperature=0.0, ignore_eos=True))))
    records = sorted(result.records, key=lambda r: r.index)
    assert all(r.ok for r in records) and len(records) == 9
    for user in range(3):  # each turn's prompt holds the one before it, its answer and a new question
        lengths = [r.prompt_tokens for r in records[3 * user:3 * user + 3]]
        assert lengths[0] < lengths[1] < lengths[2] and lengths[1] - lengths[0] > 12 + 6
    later = [r for r in records if r.index % 3]
    assert all(r.cached_tokens and r.cached_tokens >= 64 for r in later)  # the history's full blocks at least
    assert result.summary["cached_token_rate"] > 0.3
    assert result.summary["server_prefix_cache_hit_rate"] > 0.3


def test_a_users_own_history_opens_the_conversation_exactly_as_long_as_asked():
    """production-stack's multi-round QA shape: a shared system prompt, then each user's own context (earlier
    history, a document) before the first question; later turns add only their question."""
    tokenizer = load_tokenizer(None)
    specs = conversations(tokenizer, users=2, turns=3, system_len=40, question_len=12, output_len=6, seed=1,
                          history_len=200)
    assert [s.prompt_tokens for s in specs] == [212, 12, 12, 212, 12, 12]
    assert [len(tokenizer.encode(s.prompt, add_special_tokens=False)) for s in specs] == [212, 12, 12] * 2
    assert specs[0].prompt[:200] != specs[3].prompt[:200]
    plain = conversations(tokenizer, users=2, turns=3, system_len=40, question_len=12, output_len=6, seed=1)
    assert [s.prompt_tokens for s in plain] == [12] * 6


def test_a_conversations_warm_up_prompts_are_as_long_as_a_first_turn():
    tokenizer = load_tokenizer(None)
    workload = Workload(6, 0, 6, users=2, turns=3, system_prompt_len=40, question_len=12, user_history_len=200)
    warm = workload.warmup(tokenizer, 9, 3, workload.build(tokenizer, 1))
    assert [s.prompt_tokens for s in warm] == [252] * 3 and all(s.max_tokens == 6 for s in warm)
    assert "system=40 history=200 question=12" in workload.describe()


def test_the_cli_refuses_conversation_options_that_would_do_nothing():
    runner = CliRunner()
    base = ["loadtest", "run", "--target", "http://127.0.0.1:9#m"]
    for extra, said in ((["--users", "2"], "--endpoint chat"),
                        (["--turns", "3"], "add --users"),
                        (["--user-history-len", "300"], "add --users"),
                        (["--users", "2", "--endpoint", "chat", "--requests", "5"], "drop --requests"),
                        (["--users", "2", "--endpoint", "chat", "--workers", "2"], "one client process")):
        out = runner.invoke(cli, base + extra)
        text = " ".join(out.output.replace("│", " ").split())  # rich wraps the message in a box
        assert out.exit_code == 2 and said in text, text
