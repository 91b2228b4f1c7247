"""`bench-loops`: conversations driven over HTTP against two real sidecars (tiny random model), the
report's fields and summary, the round-robin order, the workload's validation."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from openalice_runner.bench.loop_targets import OFF_POLICY, parse_targets
from openalice_runner.bench.loops import (
    Call,
    CallRecord,
    Conversation,
    Target,
    bench_loops,
    format_table,
    load_loops,
    paired_calls,
    schedule,
    stream_call,
    summarize,
)
from tests.stand_ins.serve import ServerThread

LOOPS = [
    {
        "id": "loop-tools",
        "tools": [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                   "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}],
        "messages": [{"role": "system", "content": "You edit files."},
                     {"role": "user", "content": "Open a.py and rename f to g."}],
        "steps": [
            {"call": {"turn_type": "tool_call", "max_tokens": 32, "tool_choice": "required",
                      "expect_tool_call": {"name": "read_file", "arguments": {"path": "a.py"}}}},
            {"tool_result": "{context}", "context": {"stdlib": "textwrap", "lines": [1, 12]}},
            {"call": {"turn_type": "code_edit", "max_tokens": 16}},
            {"user": "Now rename x to y as well."},
            {"call": {"turn_type": "code_edit", "max_tokens": 16}},
        ],
    },
    {
        "id": "loop-chat-plan",
        "tools": [],
        "messages": [{"role": "user", "content": "Plan a trip to Porto."}],
        "steps": [{"call": {"turn_type": "chat", "max_tokens": 12}}, {"user": "Shorter."},
                  {"call": {"turn_type": "chat", "max_tokens": 12}}],
    },
]


@pytest.fixture(scope="module")
def loops_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("loops") / "loops.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in LOOPS) + "\n")
    return path


@pytest.fixture(scope="module")
def sidecars(tmp_path_factory):
    """`policy` and `off`: the sidecar app, each with its own tiny random engine (fp32, batching,
    prefix reuse on), the repository's default policy against one whose default is off."""
    from openalice_runner.runner import Runner
    from openalice_runner.server.app import ServerSettings, create_app

    tmp = tmp_path_factory.mktemp("sidecars")
    providers = tmp / "providers.yaml"
    providers.write_text("providers:\n  local: {type: local, tiny_random: true}\n"
                         "routes:\n  - {name: default, chain: [local]}\n")
    off = tmp / "off.yaml"
    off.write_text(OFF_POLICY)
    servers, targets = [], []
    for name, policy in (("policy", None), ("off", str(off))):
        runner = Runner.from_config(providers=str(providers), policy=policy, telemetry=False)
        asyncio.run(runner.providers["local"].ensure_loaded())  # as the sidecar starts (the stand-in skips it)
        server = ServerThread(create_app(runner, settings=ServerSettings())).start()
        servers.append(server)
        targets.append(Target(name, f"{server.url}/v1"))
    yield targets
    for server in servers:
        server.stop()


def test_report_fields_and_summary(loops_file, sidecars):
    conversations = load_loops(loops_file)
    assert conversations[0].steps[1].text.startswith('"""Text wrapping')
    lines: list[str] = []
    report = bench_loops(conversations, sidecars, repeat=2, progress=lines.append)
    assert [line.split(':')[0] for line in lines[:2]] == ["policy", "off"]  # a warm-up call each first
    assert len([line for line in lines if line.startswith("run ")]) == 2 * 2 * 2  # repeats x conversations x targets
    rows = report["conversations"]
    assert [(r["id"], r["target"]) for r in rows] == [
        ("loop-tools", "policy"), ("loop-tools", "off"), ("loop-chat-plan", "policy"), ("loop-chat-plan", "off")]
    assert report["kept"] == "slower middle of 2"
    assert set(report["warmup_seconds"]) == {"policy", "off"}
    for row in rows:
        assert row["seconds"] > 0 and len(row["runs_seconds"]) == 2
        assert row["seconds"] == max(row["runs_seconds"])  # two runs: the slower middle one, as named
        assert row["kind"] == ("chat" if row["id"] == "loop-chat-plan" else "copy_heavy")
        # the conversation's wall time holds all its calls
        assert row["seconds"] >= sum(c["seconds"] for c in row["calls"]) - 1e-3  # figures are rounded
        assert [c["turn_type"] for c in row["calls"]] == (
            ["tool_call", "code_edit", "code_edit"] if row["id"] == "loop-tools" else ["chat", "chat"])
        for call in row["calls"]:
            assert 0 < call["ttft_s"] <= call["seconds"]
            assert call["completion_tokens"] >= 1
            assert isinstance(call["cached_tokens"], int)
            assert call["speculation"] is not None and "method" in call["speculation"]
        # a later call resends the history: the sidecar serves its start from the previous call's cache
        for before, later in zip(row["calls"], row["calls"][1:], strict=False):
            assert later["cached_tokens"] > 0
            if row["id"] == "loop-chat-plan":  # the reply went back as it came: all of it is cached
                assert later["cached_tokens"] >= before["prompt_tokens"] + before["completion_tokens"] - 1
    offs = [c["speculation"]["method"] for r in rows if r["target"] == "off" for c in r["calls"]]
    assert set(offs) == {"off"}
    summary = report["summary"]
    assert set(summary["targets"]) == {"policy", "off"}
    for s in summary["targets"].values():
        assert s["ttft_p50_first_s"] > 0 and s["ttft_p50_later_s"] > 0
        assert s["ttft_later_over_first"] == pytest.approx(s["ttft_p50_later_s"] / s["ttft_p50_first_s"], rel=0.05)
    by = {(r["id"], r["target"]): r["seconds"] for r in rows}
    pair = summary["speedup"]["policy/off"]
    assert pair["copy_heavy"] == pytest.approx(by["loop-tools", "off"] / by["loop-tools", "policy"], rel=0.01)
    assert pair["chat"] == pytest.approx(by["loop-chat-plan", "off"] / by["loop-chat-plan", "policy"], rel=0.01)
    assert pair["all"] == pytest.approx(math.sqrt(pair["copy_heavy"] * pair["chat"]), rel=0.01)
    # greedy and exact: the policy's outputs are off's, call by call, in every repeat
    assert summary["outputs"]["policy"] == {"identical_to_off": "10/10", "mismatches": []}
    table = format_table(report)
    assert "policy/off" in table and "loop-chat-plan" in table
    json.dumps(report)  # the contract is JSON


def test_summary_on_scripted_rows():
    def row(i, target, seconds, ttfts, kind="copy_heavy"):
        calls = [{"ttft_s": t, "seconds": t + 1, "completion_tokens": 10, "cached_tokens": 0} for t in ttfts]
        return {"id": i, "kind": kind, "target": target, "seconds": seconds, "calls": calls}

    rows = [row("a", "x", 2.0, [1.0, 0.1]), row("a", "y", 8.0, [1.0, 0.3]),
            row("b", "x", 1.0, [2.0, 0.2, 0.4]), row("b", "y", 2.0, [3.0, 0.5, 0.1]),
            row("c", "x", 3.0, [1.0], kind="chat"), row("c", "y", 3.0, [1.0], kind="chat")]
    s = summarize(rows, ["x", "y"])
    assert s["speedup"]["x/y"] == {"all": round(8 ** (1 / 3), 3), "copy_heavy": round(math.sqrt(8), 3), "chat": 1.0}
    assert s["targets"]["x"]["ttft_p50_first_s"] == 1.0 and s["targets"]["x"]["ttft_p50_later_s"] == 0.2
    assert s["targets"]["y"]["ttft_later_over_first"] == 0.3
    assert s["targets"]["x"]["seconds_total"] == 6.0
    # per token: x's calls take 2.0+1.1+3.0+1.2+1.4+2.0 = 10.7 s for 60 tokens, y's 11.9 s for 60
    assert s["targets"]["x"]["ms_per_token"] == pytest.approx(1000 * 10.7 / 60, abs=1e-3)
    assert s["speedup_per_token"]["x/y"] == pytest.approx(11.9 / 10.7, abs=1e-3)


def test_paired_calls_are_the_median_difference_of_the_same_calls_with_the_same_output():
    def record(ttft, seconds, content="same"):
        return CallRecord("chat", ttft, seconds, 1, 0, 1, None, content)

    runs = {
        ("a", "front"): [{"run": 0, "calls": [record(0.11, 1.02), record(0.21, 2.0), record(0.5, 3.0, "other")]},
                         {"run": 1, "calls": [record(0.13, 1.03)]}],
        ("a", "direct"): [{"run": 0, "calls": [record(0.10, 1.0), record(0.20, 1.99), record(0.1, 0.1)]},
                          {"run": 1, "calls": [record(0.10, 1.0)]}],
    }
    pair = paired_calls(runs, ["front", "direct"])["front-direct"]
    # three pairs with equal outputs (10, 10, 30 ms TTFT; 20, 10, 30 ms in all); the differing one left out
    assert pair == {"calls_paired": "3/4", "ttft_p50_ms": 10.0, "seconds_p50_ms": 20.0}


def test_before_run_is_called_before_every_timed_conversation(loops_file, sidecars):
    calls: list[str] = []
    conversations = load_loops(loops_file)[:1]
    bench_loops(conversations, sidecars, repeat=1, warmup=0,
                progress=lambda _line: calls.append("run"), before_run=lambda: calls.append("reset"))
    assert calls == ["reset", "run"] * len(sidecars)


def test_round_robin_order():
    conversations = [Conversation(f"c{i}", [], [{"role": "user", "content": "hi"}], []) for i in range(3)]
    targets = [Target(n, "http://x/v1") for n in ("p", "o", "l")]
    order = schedule(conversations, targets, repeat=2)
    assert len(order) == 2 * 3 * 3
    blocks = [order[k:k + 3] for k in range(0, len(order), 3)]
    for block in blocks:  # one conversation of one repeat on every target in turn
        assert len({(run, c.id) for run, c, _ in block}) == 1
        assert sorted(t.name for _, _, t in block) == ["l", "o", "p"]
    firsts = [block[0][2].name for block in blocks]
    assert firsts == ["p", "o", "l", "o", "l", "p"]  # the first target rotates
    assert [run for run, _, _ in order] == [0] * 9 + [1] * 9


def test_workload_and_targets_are_checked(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "messages": [{"role": "user", "content": "hi"}],
                               "steps": [{"call": {"turn_type": "chat"}}]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*max_tokens"):
        load_loops(bad)
    with pytest.raises(ValueError, match="unknown target 'llama'"):
        parse_targets("policy,llama")
    with pytest.raises(ValueError, match="URL=NAME"):
        parse_targets("localhost:8080=peer")
    specs = parse_targets("policy,http://127.0.0.1:9/=peer")
    assert specs[1].name == "peer" and specs[1].url == "http://127.0.0.1:9/v1"


def test_a_call_cut_short_is_not_one_the_loop_runs():
    """A tool call streamed until max_tokens cut it has arguments that stop short: the loop answers
    the workload's expected call instead of sending the cut one back."""
    from openalice_runner.bench.loops import _runnable

    def call(arguments):
        return {"id": "c", "type": "function", "function": {"name": "read_file", "arguments": arguments}}

    assert _runnable(call('{"path": "a.py"}')) and _runnable(call(""))
    assert not _runnable(call('{"path": "a.')) and not _runnable(call("[1]"))


def test_a_server_without_usage_is_counted_in_chunks():
    """llama-cpp-python's server streams no usage: its tokens are its streamed chunks (one a token)."""
    import httpx

    events = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]}]
    events += [{"choices": [{"delta": {"content": piece}}]} for piece in ("Lis", "bon", ".")]
    events += [{"choices": [{"delta": {}, "finish_reason": "stop"}]}]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
    with httpx.Client(transport=transport) as client:
        record = stream_call(client, Target("peer", "http://peer/v1", "m"), [{"role": "user", "content": "Hi"}],
                             [], Call("chat", 8), {})
    assert (record.completion_tokens, record.tokens_counted, record.content) == (3, "chunks", "Lisbon.")


def test_vllm_targets_are_skipped_without_their_venv_and_launched_from_it(tmp_path, monkeypatch):
    """`vllm` / `vllm-ngram`: skipped, naming the script to run, where the side venv is not built; else
    the serve script's line with prefix caching, cached-token usage and (for -ngram) n-gram speculation."""
    from openalice_runner.bench import loop_targets
    from openalice_runner.bench.loop_targets import Servers, TargetSpec, TargetUnavailable
    from openalice_runner.engine import model_loading

    assert [s.name for s in parse_targets("vllm,vllm-ngram")] == ["vllm", "vllm-ngram"]
    monkeypatch.setenv("OPENALICE_VLLM_VENV", str(tmp_path / "absent"))
    with Servers() as servers, pytest.raises(TargetUnavailable, match="scripts/peer-vllm-cpu.sh"):
        servers.start(TargetSpec("vllm"))

    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".openalice-verified").write_text("ok\n")
    monkeypatch.setenv("OPENALICE_VLLM_VENV", str(venv))
    monkeypatch.setattr(model_loading, "resolve_model_source", lambda model: model)
    monkeypatch.setattr(model_loading, "converted_folder", lambda source: tmp_path / "model")
    with Servers() as servers:
        plain = servers._vllm(False, 8001)
        ngram = servers._vllm(True, 8002)
    assert plain[:5] == ["bash", str(loop_targets.VLLM_SERVE), str(tmp_path / "model"), "8001", "--enable-prefix-caching"]
    assert "--enable-prompt-tokens-details" in plain and "--speculative-config" not in plain
    spec = json.loads(ngram[ngram.index("--speculative-config") + 1])
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] >= 1


def test_an_inferred_target_calls_as_claude_code_does():
    """`policy-inferred`: the calls go to /v1/messages with no X-OpenAlice-* header, the conversation
    as Claude Code's session id (its header and `metadata.user_id`), tool_choice in Anthropic's words;
    the stated twin sends Chat Completions with the headers."""
    import httpx

    from openalice_runner.bench.loops import Conversation, Step, run_conversation

    seen: list[tuple[str, dict, dict]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, {k.lower(): v for k, v in request.headers.items()}, json.loads(request.content)))
        if request.url.path.endswith("/messages"):
            events = [{"type": "message_start", "message": {"usage": {"input_tokens": 0, "output_tokens": 0}}},
                      {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                      {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "ok"}},
                      {"type": "content_block_stop", "index": 0},
                      {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                       "usage": {"input_tokens": 3, "output_tokens": 1, "cache_read_input_tokens": 2}},
                      {"type": "message_stop"}]
            return httpx.Response(200, text="".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events))
        events = [{"choices": [{"delta": {"content": "ok"}}]}, {"choices": [{"delta": {}, "finish_reason": "stop"}]}]
        return httpx.Response(200, text="".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n")

    conversation = Conversation("c", [], [{"role": "user", "content": "Hi"}],
                                [Step("call", Call("summarize", 4, "none")), Step("user", text="More."),
                                 Step("call", Call("chat", 4))])
    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        inferred_row = run_conversation(client, Target("policy-inferred", "http://x/v1", "m", stated=False),
                                        conversation, 0)
        run_conversation(client, Target("policy", "http://x/v1", "m"), conversation, 0)
    inferred, stated = seen[:2], seen[2:]
    for path, headers, body in inferred:
        assert path == "/v1/messages"
        assert not [k for k in headers if k.startswith("x-openalice-")]
        assert headers["x-claude-code-session-id"] == "c.policy-inferred.0"
        assert json.loads(body["metadata"]["user_id"]) == {"session_id": "c.policy-inferred.0"}
        assert "prompt_cache_key" not in body
    assert inferred[0][2]["tool_choice"] == {"type": "none"} and "tool_choice" not in inferred[1][2]
    # the second call resends the first reply as an assistant turn of text blocks
    assert inferred[1][2]["messages"][1] == {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}
    first = inferred_row["calls"][0]
    # read back in Chat's terms: Anthropic's input_tokens leave the cached ones out
    assert (first.content, first.finish_reason, first.prompt_tokens, first.cached_tokens,
            first.completion_tokens) == ("ok", "stop", 5, 2, 1)
    assert [p for p, _, _ in stated] == ["/v1/chat/completions"] * 2
    assert [h["x-openalice-turn-type"] for _, h, _ in stated] == ["summarize", "chat"]
    assert {h["x-openalice-conversation-id"] for _, h, _ in stated} == {"c.policy.0"}
    assert [s.name for s in parse_targets("policy,off,policy-inferred,off-inferred")][2:] == [
        "policy-inferred", "off-inferred"]
    with pytest.raises(ValueError, match="unknown target"):
        parse_targets("vllm-inferred")


def test_an_inferred_twin_over_the_messages_wire_gets_the_stated_outputs_with_inferred_turns(loops_file, sidecars):
    """The same conversation through a real sidecar, stated over Chat and inferred over Messages:
    the same greedy outputs (tool calls included) call by call, the reply's speculation says the
    turn type and conversation were inferred, and the later calls find their prefix cached (the
    session id keyed the conversation)."""
    from openalice_runner.bench.loops import run_conversation

    conversation = load_loops(loops_file)[0]
    policy = sidecars[0]
    import httpx

    with httpx.Client(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        stated = run_conversation(client, policy, conversation, 7)
        inferred = run_conversation(client, Target("policy-inferred", policy.url, policy.model, stated=False),
                                    conversation, 7)
    assert [c.output for c in inferred["calls"]] == [c.output for c in stated["calls"]]
    assert [c.finish_reason for c in inferred["calls"]] == [c.finish_reason for c in stated["calls"]]
    assert inferred["calls"][0].tool_calls  # the forced tool call came back as a tool_use block
    for call in inferred["calls"]:
        assert call.speculation["turn_type_source"] == "inferred"
        assert call.speculation["conversation_source"] == "inferred"
    for call in stated["calls"]:
        assert call.speculation["turn_type_source"] == "stated"
    assert all(c.cached_tokens > 0 for c in inferred["calls"][1:])
    assert [c.prompt_tokens for c in inferred["calls"]] == [c.prompt_tokens for c in stated["calls"]]


def test_inferred_over_stated_is_the_twins_speedup_over_the_pairs():
    from openalice_runner.bench.loops import inferred_over_stated

    ratios = {"policy/off": {"all": 1.5, "copy_heavy": 2.0, "chat": 1.0},
              "policy-inferred/off-inferred": {"all": 1.35, "copy_heavy": 1.8, "chat": None},
              "policy/policy-inferred": {"all": 1.0, "copy_heavy": 1.0, "chat": 1.0}}
    assert inferred_over_stated(ratios) == {"policy/off": {"all": 0.9, "copy_heavy": 0.9, "chat": None}}


def test_a_loop_sends_back_only_the_call_its_tool_result_answers():
    """The model calls tools where the workload has no result for them: the loop sends those calls
    back to no one (a real API refuses a call without its result), and of two calls before a tool
    result only the one that result answers."""
    import httpx

    from openalice_runner.bench.loops import Conversation, Step, run_conversation

    seen: list[dict] = []

    def call(i: int) -> dict:
        return {"index": i, "id": f"c{i}", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        events = [{"choices": [{"delta": {"tool_calls": [call(0), call(1)]}}]},
                  {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}]
        return httpx.Response(200, text="".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n")

    conversation = Conversation("c", [], [{"role": "user", "content": "Hi"}],
                                [Step("call", Call("tool_call", 8)), Step("tool_result", text="x = 1"),
                                 Step("call", Call("chat", 8)), Step("user", text="More."), Step("call", Call("chat", 8))])
    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        run_conversation(client, Target("policy", "http://x/v1", "m"), conversation, 0)
    last = seen[-1]["messages"]
    assert [m["role"] for m in last] == ["user", "assistant", "tool", "assistant", "user"]
    assert [c["id"] for c in last[1]["tool_calls"]] == ["c1"] and last[2]["tool_call_id"] == "c1"
    assert "tool_calls" not in last[3] and last[3]["content"] == ""


def test_every_call_reports_its_time_to_first_token_by_part(loops_file, sidecars):
    """Issue 49: each call's `speculation.first_token` names the server's parse, the prompt's template,
    tokenizing and grammar, the engine's queue, prefix match, prefill passes and first token; the parts
    come to no more than the time to the first chunk the loop measured; the summary adds them up."""
    conversations = load_loops(loops_file, ["loop-tools"])
    report = bench_loops(conversations, sidecars, repeat=1, warmup=0)
    for row in report["conversations"]:
        for k, call in enumerate(row["calls"]):
            breakdown = call["speculation"]["first_token"]
            parts = breakdown["parts_ms"]
            expected = {"parse", "template", "tokenize", "grammar", "queue", "prefix_match", "prefill", "first_token",
                        "held_back"}
            assert expected <= set(parts), (k, parts)
            assert k == 0 or "history_align" in parts  # a later call's ids are matched to the history's
            assert all(ms >= 0 for ms in parts.values())
            assert breakdown["total_ms"] <= 1000 * call["ttft_s"] + 0.05  # ttft_s is rounded to 0.1 ms
            # every prompt token not served from the cache went through one of the prefill passes
            assert sum(t for t, _ in breakdown["prefill_chunks"]) == call["prompt_tokens"] - call["cached_tokens"]
    summary = report["summary"]["first_token"]
    for target in ("policy", "off"):
        later = summary[target]["later"]
        assert later["calls"] == later["reported"] == 2
        assert later["rest_ms"] >= 0 and later["new_prompt_tokens"] > 0 and later["prefill_tokens_per_s"] > 0
        # less the part held back (the reply's decode rounds), the same tokens over less time (the
        # summary's ms are rounded to 0.1 ms, a few ms in all on the tiny engine: within 2%)
        unheld_ms = later["ttft_ms"] - later["parts_ms"]["held_back"]
        assert later["unheld_tokens_per_s"] == pytest.approx(1000 * later["new_prompt_tokens"] / unheld_ms, rel=0.02)
        assert later["unheld_tokens_per_s"] >= later["new_tokens_per_s"]
    assert "time to first token, ms summed" in format_table(report)
    assert "tok/s less held back" in format_table(report)


def test_the_long_prompt_is_timed_in_the_same_run_and_held_against_the_later_calls(loops_file, sidecars):
    """Issue 49: `long_prompt` sends one long prompt per repeat through every target before its
    conversations (a new one each repeat: nothing cached of it); its rate is summed as the loops'
    calls are and the later calls' rates are given over it."""
    from openalice_runner.bench.loop_long_prompt import LONG_PROMPT_TOKENS, long_prompt

    assert long_prompt(0) != long_prompt(1)
    conversations = load_loops(loops_file, ["loop-tools"])
    report = bench_loops(conversations, sidecars, repeat=2, warmup=0, long_prompt=True)
    summary = report["summary"]["first_token"]
    for target in ("policy", "off"):
        long = summary[target]["long"]
        assert long["calls"] == long["reported"] == 2
        # two calls (the tiny engine's tokenizer is not SmolLM2's: each long, not exactly 1,200)
        assert long["new_prompt_tokens"] >= LONG_PROMPT_TOKENS
        ratio = summary[target]["later_over_long"]
        later = summary[target]["later"]
        assert ratio["prefill_tokens_per_s"] == round(later["prefill_tokens_per_s"] / long["prefill_tokens_per_s"], 3)
        assert ratio["new_tokens_per_s"] == round(later["new_tokens_per_s"] / long["new_tokens_per_s"], 3)
        assert ratio["unheld_tokens_per_s"] == round(later["unheld_tokens_per_s"] / long["unheld_tokens_per_s"], 3)
    assert "later / long" in format_table(report)
    plain = bench_loops(conversations, sidecars[:1], repeat=1, warmup=0)
    assert "long" not in plain["summary"]["first_token"]["policy"]  # off unless asked
