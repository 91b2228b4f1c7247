"""Tool calls read out of a streaming reply (providers/embedded/tool_stream.py) and the canonical JSON re-writer
under it (providers/embedded/json_stream.py): torch-free, text in, deltas out."""

from __future__ import annotations

import json
import random

import pytest

from openalice_runner.providers.embedded import tool_format
from openalice_runner.providers.embedded.json_stream import CanonicalJSON, JSONStreamError
from openalice_runner.providers.embedded.tool_stream import ToolCallStream

NAMES = {"get_weather", "get_time", "get"}
OBJECTS = [
    "{}",
    '{"city": "Lima", "days": 2.50, "n": 1e5, "z": -0, "w": 1E400, "f": 1.5e-3, "big": 12345678901234567890}',
    '{"s": "tab\\there \\u001F \\"q\\" \\\\ \\/ \\u00e9 é 😀 \\ud83d\\ude00 lone \\ud83d."}',
    '{"a": [[], [{}], [1, [2, [true, false, null]]]], "b": {"c": {"d": []}}}',
    '{ "spaced" :  [ 1 , 2 ] ,"x":{} }',  # whitespace the grammar never writes: dropped all the same
]


def _splits(text: str, rng: random.Random) -> list[str]:
    pieces, at = [], 0
    while at < len(text):
        n = rng.randint(1, 6)
        pieces.append(text[at : at + n])
        at += n
    return pieces


@pytest.mark.parametrize("raw", OBJECTS)
def test_canonical_json_pieces_join_to_json_dumps_of_the_parsed_object(raw):
    """Whatever the splits, the pieces join to json.dumps(json.loads(raw), ensure_ascii=False) (what
    an unstreamed tool call's arguments are), and no joined prefix parses before the end."""
    want = json.dumps(json.loads(raw), ensure_ascii=False)
    rng = random.Random(raw)
    for _ in range(200):
        reader, out, pieces = CanonicalJSON(), [], _splits(raw + "}\n</tool_call>", rng)
        while not reader.done:
            text, rest = reader.feed(pieces.pop(0))
            out.append(text)
        assert "".join(out) + "}" == want
        assert rest + "".join(pieces) == "}\n</tool_call>"  # the call's own brace on: not consumed
        joined = ""
        for text in out:
            joined += text
            with pytest.raises(json.JSONDecodeError):
                json.loads(joined)


def test_canonical_json_hands_back_the_text_after_the_object():
    reader = CanonicalJSON()
    assert reader.feed('{"a": 1}}\n</tool_call>') == ('{"a": 1', "}\n</tool_call>")
    assert reader.done


@pytest.mark.parametrize("bad", ["[1]", '{"a" 1}', '{"a": 1,}', '{"a": x}', '{"a": "\x01"}', "{,}", '{"a": 1]', '{"a": tru}'])
def test_canonical_json_refuses_what_is_not_one_object(bad):
    with pytest.raises(JSONStreamError):
        CanonicalJSON().feed(bad + "}")


CALLS = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "days": 2.50}}\n</tool_call>'
    '\n<tool_call>\n{"name": "get", "arguments": {}}\n</tool_call>'
)


def _run(stream: ToolCallStream, pieces: list[str]):
    out = []
    for piece in pieces:
        out.append(stream.feed(piece))
    end = stream.finish()
    return out, end


def _joined(pieces_per_feed, end):
    content, calls = "", {}
    for piece in [p for ps in pieces_per_feed for p in ps] + end.pieces:
        content += piece.content or ""
        for d in piece.tool_calls or ():
            if d.index not in calls:
                assert d.id and d.function.name and d.type == "function"
                calls[d.index] = [d.function.name, d.function.arguments]
            else:
                assert d.id is None and d.function.name is None
                calls[d.index][1] += d.function.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("seed", range(20))
def test_incremental_calls_join_to_the_parsed_reply(seed):
    pieces = _splits(CALLS, random.Random(seed))
    per_feed, end = _run(ToolCallStream("", NAMES, incremental=True), pieces)
    content, calls = _joined(per_feed, end)
    parsed = tool_format.parse_tool_calls(CALLS, NAMES)
    assert calls == [(c.function.name, c.function.arguments) for c in parsed.tool_calls]
    assert calls == [("get_weather", '{"city": "Lima", "days": 2.5}'), ("get", "{}")]
    assert content == "Let me check.\n" and end.calls == 2 and not end.cut


def test_the_first_delta_comes_with_the_arguments_brace():
    stream = ToolCallStream("", NAMES, incremental=True)
    opening = '<tool_call>\n{"name": "get_weather", "arguments": '
    assert all(stream.feed(ch) == [] for ch in opening)  # no delta before the arguments open
    first = stream.feed("{")
    assert [(d.index, d.function.name, d.function.arguments) for p in first for d in p.tool_calls] == [
        (0, "get_weather", ""), (0, None, "{")
    ]
    assert [d.function.arguments for p in stream.feed('"city": "L') for d in p.tool_calls] == ['"city": "L']


def test_a_prefilled_opening_goes_out_with_the_first_text():
    prefill = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'
    stream = ToolCallStream(prefill, NAMES, incremental=True)
    pieces = stream.feed("Li")
    assert [d.function.arguments for p in pieces for d in p.tool_calls] == ["", '{"city": "Li']
    assert stream.feed('ma"}') != [] and [p.tool_calls[0].function.arguments for p in stream.feed("}\n")] == ["}"]
    assert stream.finish().calls == 1


def test_without_a_grammar_calls_are_held_to_the_end():
    """Unconstrained: nothing of a call block goes out before the reply is complete; a malformed
    block is content then, never a call half-streamed."""
    per_feed, end = _run(ToolCallStream("", NAMES, incremental=False), list(CALLS))
    assert not any(p.tool_calls for ps in per_feed for p in ps)
    assert "".join(p.content or "" for ps in per_feed for p in ps) == "Let me check.\n"
    (last,) = end.pieces
    assert [(d.index, d.function.name, d.function.arguments) for d in last.tool_calls] == [
        (0, "get_weather", '{"city": "Lima", "days": 2.5}'), (1, "get", "{}")
    ]
    malformed = '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
    per_feed, end = _run(ToolCallStream("", NAMES, incremental=False), list(malformed))
    assert not any(ps for ps in per_feed)
    assert [(p.content, p.tool_calls) for p in end.pieces] == [(malformed, None)] and end.calls == 0


def test_a_block_off_the_grammars_layout_is_held_and_parsed():
    """What strays from the layout before a call's first delta (no newline after the tag, an
    unknown tool) is held and parsed at the end, as without a grammar."""
    for text in ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
                 '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'):  # fmt: skip
        per_feed, end = _run(ToolCallStream("", NAMES, incremental=True), list(text))
        assert not any(ps for ps in per_feed)
        parsed = tool_format.parse_tool_calls(text, NAMES)
        content, calls = _joined([], end)
        assert calls == [(c.function.name, c.function.arguments) for c in parsed.tool_calls]
        assert (content or None) == parsed.content


def test_a_call_cut_short_is_reported():
    per_feed, end = _run(ToolCallStream("", NAMES, incremental=True), list(CALLS[: CALLS.index("2.50")]))
    content, calls = _joined(per_feed, end)
    assert calls == [("get_weather", '{"city": "Lima", "days": ')] and end.cut and end.calls == 0


def test_no_tools_all_text_is_content():
    per_feed, end = _run(ToolCallStream("", None, incremental=False), ["<tool_call>", "\n{}"])
    assert [p.content for ps in per_feed for p in ps] == ["<tool_call>", "\n{}"] and end.pieces == []
