"""`bench-constrained` on the tiny model: every mode runs on the same prompt, the constrained modes
agree token for token, a tool-call turn's grammar is one call that ends, the report holds every
figure issue 22 asks for, and `parses` accepts only the requested shape."""

from __future__ import annotations

import json

import pytest

from openalice_runner.bench.constrained import (
    MODES,
    bench_constrained,
    constrained_cases,
    format_table,
    parses,
    serve_prompt,
    summarize,
)
from openalice_runner.bench.workload import Case, load_workload

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}}}
READ = {"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
TOOL_CASE = Case("t", "tool_call", [{"role": "user", "content": "weather in Oslo?"}], 64, [WEATHER, READ])
RAG_CASE = Case("r", "rag", [{"role": "user", "content": "What does it say?"}], 64)


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class Spy:
    """The tiny engine, recording the prompt of every generate call."""

    def __init__(self, engine):
        self._engine = engine
        self.prompts: list[list[int]] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, prompt, *args, **kwargs):
        self.prompts.append(list(prompt))
        return self._engine.generate(prompt, *args, **kwargs)


def test_bench_constrained_runs_every_mode_on_one_prompt(tiny_engine, workload_path):
    cases = load_workload(workload_path, ["tool-weather", "rag-quote"])
    cases = [c.__class__(**{**c.__dict__, "max_tokens": 24}) for c in cases]
    spy = Spy(tiny_engine)
    report = bench_constrained(spy, cases, gamma=3)
    assert [r["case"] for r in report["runs"]] == ["tool-weather", "rag-quote-json"]
    assert len(spy.prompts) == 8
    assert all(p == spy.prompts[0] for p in spy.prompts[:4]) and all(p == spy.prompts[4] for p in spy.prompts[4:])
    tool_row, rag_row = report["runs"]
    assert tool_row["prefill"] == '<tool_call>\n{"name": "'  # as the local provider serves "required"
    assert rag_row["prefill"] == ""
    for row in report["runs"]:
        assert set(row["modes"]) == set(MODES)
        assert row["constrained_identical"]  # greedy: the grammar's tokens, however drafted
        assert row["modes"]["constrained-forced"]["forced"] > 0
        assert row["modes"]["constrained-off"]["forced"] == 0
        assert row["modes"]["unconstrained-off"]["mask_s"] == 0
        assert row["modes"]["constrained-off"]["mask_s"] > 0
        for figures in row["modes"].values():
            for key in ("tokens_per_s", "decode_tokens_per_s", "tokens_per_pass", "mask_ms_per_token", "parses", "finish_reason"):
                assert key in figures
            assert figures["reply"].startswith(row["prefill"])
    s = report["summary"]
    assert s["mask_ms_per_token"] > 0 and s["plain_step_ms"] > 0 and s["mask_share_of_plain_step"] > 0
    assert s["forced_ngram_vs_constrained_off_tool_call"] > 0
    assert s["forced_ngram_vs_constrained_off_structured"] > 0
    assert set(s["parse"]) == set(MODES) and all(p["replies"] == 2 for p in s["parse"].values())
    table = format_table(report)
    for figure in ("tok/s", "decode tok/s", "decode tokens/s", "tokens/pass", "mask ms/token", "parses", "constrained+forced+ngram / constrained off",
                   "structured summarize/rag", "target ≥ 1.3×", "plain decode step", "replies that parse"):
        assert figure in table


def test_tool_call_cases_ask_for_one_call_and_structured_cases_for_the_schema():
    (tool_case, tool_request), (rag_case, rag_request) = constrained_cases([TOOL_CASE, RAG_CASE])
    assert tool_request.tool_choice == "required" and tool_request.parallel_tool_calls is False
    assert tool_request.max_tokens == 64 and tool_case is TOOL_CASE
    assert rag_case.id == "r-json" and rag_request.response_format.type == "json_schema"
    assert rag_request.response_format.json_schema.schema_ == rag_case.extra["schema"]
    assert rag_request.messages[-1].text.startswith("What does it say?\n\nReply with one JSON object")
    assert constrained_cases([Case("c", "chat", [{"role": "user", "content": "hi"}], 8)]) == []


def test_the_tool_call_grammar_is_one_call_that_ends(tiny_engine):
    served = serve_prompt(tiny_engine, constrained_cases([TOOL_CASE])[0][1])
    assert served.stop == ("</tool_call>",)
    constraint = served.grammar.constraint()
    one = call("get_weather", {"city": "Oslo"})[len(served.prefill):]
    first = tiny_engine.encode(one)
    second = tiny_engine.encode("\n" + call("read_file", {"path": "a"}))
    n, masks = constraint.walk(first + second)
    assert n == len(first)  # the second call is cut: parallel_tool_calls is false
    eos = sorted(tiny_engine.eos_token_ids)
    assert bool(masks[n][eos].any()) and int(masks[n].sum()) == len(eos)  # after the call: the end, only
    wrong = tiny_engine.encode('read_file", "arguments": {"city": "Oslo"}}')
    assert constraint.walk(wrong)[0] < len(wrong)  # arguments must match the named tool's schema


@pytest.mark.parametrize(("text", "ok"), [
    (call("get_weather", {"city": "Oslo"}), True),
    (call("get_weather", {"city": "Oslo", "unit": "celsius"}).removesuffix("</tool_call>"), True),  # stopped on it
    (call("get_weather", {"city": "Oslo"}) + "\n" + call("read_file", {"path": "a"}), False),  # two calls
    (call("get_weather", {"unit": "celsius"}), False),  # a required argument missing
    (call("get_weather", {"city": "Oslo", "unit": "kelvin"}), False),  # not in the enum
    (call("send_mail", {"to": "x"}), False),  # not an offered tool
    ("Sure! " + call("get_weather", {"city": "Oslo"}), False),  # text besides the call
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os', False),  # cut by max_tokens
    ("It is sunny in Oslo.", False),
])
def test_parses_a_tool_call_turn(text, ok):
    assert parses(TOOL_CASE, text) is ok


@pytest.mark.parametrize(("text", "ok"), [
    ('{"answer": "yes", "quote": "it says so"}', True),
    ('{"answer": "yes"}', False),
    ('{"answer": "yes", "quote": "q", "extra": 1}', False),
    ('{"answer": "yes", "quote": "q"} and more', False),
    ('{"answer": "yes", "quo', False),
])
def test_parses_a_structured_turn(text, ok):
    case = constrained_cases([RAG_CASE])[0][0]
    assert parses(case, text) is ok


def test_mask_share_is_one_mask_over_one_plain_decode_step():
    def row(turn_type, plain, masked, fast):
        return {"turn_type": turn_type, "constrained_identical": True, "modes": {
            "unconstrained-off": {"tokens_per_s": 10.0, "decode_tokens_per_s": 12.0, "target_passes": plain[0], "decode_s": plain[1],
                                  "mask_s": 0.0, "parses": False},
            "constrained-off": {"tokens_per_s": 10.0, "decode_tokens_per_s": 12.0, "target_passes": masked[0], "decode_s": 1.0,
                                "mask_s": masked[1], "parses": True},
            "constrained-forced": {"tokens_per_s": fast / 2, "decode_tokens_per_s": fast, "target_passes": 1, "decode_s": 1.0, "mask_s": 0.0,
                                   "parses": True},
            "constrained-forced-ngram": {"tokens_per_s": fast, "decode_tokens_per_s": 2 * fast, "target_passes": 1, "decode_s": 1.0, "mask_s": 0.0,
                                         "parses": True},
        }}

    # plain: 0.5 s over 50 passes and 1.5 s over 50 -> 20 ms a step; masks: 0.1 s over 99 + 1
    # positions and 0.1 s over 99 + 1 -> 1 ms a mask
    s = summarize([row("tool_call", (50, 0.5), (99, 0.1), 40.0), row("rag", (50, 1.5), (99, 0.1), 20.0)])
    assert s["plain_step_ms"] == 20.0 and s["mask_ms_per_token"] == 1.0 and s["mask_share_of_plain_step"] == 0.05
    assert s["forced_ngram_vs_constrained_off_tool_call"] == 4.0
    assert s["forced_vs_constrained_off_tool_call"] == 2.0
    assert s["forced_ngram_vs_constrained_off_structured"] == 2.0
    assert s["decode_forced_ngram_vs_constrained_off_tool_call"] == round(80 / 12, 3)
    assert s["decode_forced_ngram_vs_constrained_off_structured"] == round(40 / 12, 3)
    assert s["parse"]["unconstrained-off"] == {"parsed": 0, "replies": 2, "share": 0.0}
    assert s["parse"]["constrained-off"] == {"parsed": 2, "replies": 2, "share": 1.0}
