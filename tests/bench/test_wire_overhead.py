"""bench/wire_overhead.py: the same agent-loop request written in the three wires is the same request
(exact, no timing), and a short run against a real `serve` on loopback gives a report with every field,
every call answered and the translations handing the provider the same request. Timings are not
checked: speed is the benchmark's to report, never a timed test's."""

from __future__ import annotations

import json

import pytest
from locations import SHARED_WORKLOADS

from openalice_runner.bench import wire_overhead as bench
from openalice_runner.bench.loops import load_loops

LOOPS = SHARED_WORKLOADS / "agent-loops.jsonl"
LOOP = {
    "id": "loop-read",
    "tools": [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
               "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}],
    "messages": [{"role": "user", "content": "Open a.py"}],
    "steps": [
        {"call": {"turn_type": "tool_call", "max_tokens": 8, "expect_tool_call": {"name": "read_file",
                                                                                   "arguments": {"path": "a.py"}}}},
        {"tool_result": "x = 1"},
        {"call": {"turn_type": "code_edit", "max_tokens": 8}},
    ],
}  # fmt: skip


@pytest.fixture
def workload(tmp_path):
    path = tmp_path / "loops.jsonl"
    path.write_text(json.dumps(LOOP) + "\n")
    return path


def test_the_request_is_written_alike_in_each_wire(workload):
    [loop] = load_loops(workload)
    req = bench.agent_request(loop)
    assert [m["role"] for m in req["messages"]] == ["system", "user", "assistant", "tool"]
    chat = bench.as_chat(req, "m", stream=False)
    messages = bench.as_messages(req, "m", stream=True)
    responses = bench.as_responses(req, "m", stream=False)
    assert messages["system"] == [{"type": "text", "text": bench.SYSTEM}]
    assert [t["role"] for t in messages["messages"]] == ["user", "assistant", "user"]
    [use] = messages["messages"][1]["content"]
    [result] = messages["messages"][2]["content"]
    assert (use["type"], use["input"]) == ("tool_use", {"path": "a.py"})
    assert (result["type"], result["tool_use_id"], result["content"]) == ("tool_result", use["id"], "x = 1")
    assert messages["tools"][0]["input_schema"] == chat["tools"][0]["function"]["parameters"]
    assert responses["instructions"] == bench.SYSTEM
    assert [i["type"] for i in responses["input"]] == ["message", "function_call", "function_call_output"]
    assert responses["input"][2]["call_id"] == responses["input"][1]["call_id"]
    assert responses["tools"][0]["parameters"] == chat["tools"][0]["function"]["parameters"]
    assert (chat["max_tokens"], messages["max_tokens"], responses["max_output_tokens"]) == (1, 1, 1)
    assert messages["stream"] is True and responses["store"] is False


def test_a_loop_without_an_answered_tool_call_is_left_out(tmp_path):
    loop = dict(LOOP, steps=[{"call": {"turn_type": "chat", "max_tokens": 8}}, {"user": "more"},
                             {"call": {"turn_type": "chat", "max_tokens": 8}}])  # fmt: skip
    path = tmp_path / "loops.jsonl"
    path.write_text(json.dumps(loop) + "\n")
    assert bench.agent_request(load_loops(path)[0]) is None
    with pytest.raises(ValueError, match="no loop has a tool call answered"):
        bench.run(path, 1, [False])


def test_a_short_run_reports_every_field_for_each_wire_and_mode(workload):
    """A real `serve` (its provider answering at once), 3 pairs per wire, plain and streamed."""
    path = LOOPS if LOOPS.exists() else workload
    report = bench.run(path, 3, [False, True], log=lambda _: None)
    assert report["server"] == bench.SERVERS["instant"]
    assert set(report["modes"]) == {"plain", "streamed"}
    for mode, result in report["modes"].items():
        assert result["stream"] is (mode == "streamed")
        assert result["pairs_per_wire"] == 3 and result["requests"] >= 1
        tokens = result["prompt_tokens_by_request"]
        assert set(tokens) == {"chat", "messages", "responses"}
        # each wire's translation handed the provider the same request as Chat did (its size as JSON)
        assert tokens["messages"] == tokens["chat"] == tokens["responses"] and tokens["chat"]
        assert set(result["wires"]) == {"messages", "responses"}
        for figures in result["wires"].values():
            assert figures["pairs"] == 3
            assert figures["prompt_tokens_differed"] == 0 and figures["text_differed"] == 0
            for key in ("overhead_p50_ms", "overhead_p90_ms", "wire_p50_ms", "chat_p50_ms"):
                assert isinstance(figures[key], float), key
            assert figures["wire_p50_ms"] > 0 and figures["chat_p50_ms"] > 0


def test_the_cli_writes_its_report(workload, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert bench.main(["--workload", str(workload), "--n", "1", "--mode", "plain", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["modes"]) == {"plain"}
    assert json.loads(capsys.readouterr().out) == report
