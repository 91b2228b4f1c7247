"""Grammar-constrained decoding on the engine (llguidance, the real tokenizer, a tiny random model).

Greedy constrained output is the same token for token with and without speculation and forced
drafts, serial and batched (fp32); every reply parses into the requested shape; forced tokens
are drafted for free and counted; drafts the grammar forbids are cut before verification.
"""

from __future__ import annotations

import json

import pytest
import torch

from openalice_runner.engine import Engine, SamplingParams, SpecConfig
from openalice_runner.engine.drafters.base import Drafter, Proposal
from openalice_runner.engine.grammar import GrammarError, json_grammar, tool_call_grammar
from openalice_runner.providers.embedded.tool_format import parse_tool_calls

# Short, closed values only: a random model fills a free string or integer until max_tokens.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "rain": {"type": "boolean"}},
            "required": ["unit", "rain"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
                       "additionalProperties": False},
    },
}
SHAPE = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "bb", "ccc"]}},
         "required": ["ok", "kind"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engines():
    """A serial and a batching engine over the same random weights (fp32)."""
    return [Engine.tiny_random(seed=0, max_batch=1), Engine.tiny_random(seed=0, max_batch=4)]


SPECS = [
    SpecConfig(method="off", forced_drafts=False),
    SpecConfig(method="off"),
    SpecConfig(method="ngram", gamma=4, adaptive_length=False),
    SpecConfig(method="ngram", gamma=4, forced_drafts=False, adaptive_length=False),
    SpecConfig(method="draft", gamma=3, draft_layers=1),
]


@pytest.mark.parametrize("grammar_kind", ["required", "parallel", "json_schema", "json_object", "auto"])
def test_greedy_constrained_output_is_the_same_with_and_without_speculation(engines, grammar_kind):
    texts = {
        "required": tool_call_grammar([WEATHER, TIME], "required", parallel=False),
        "parallel": tool_call_grammar([WEATHER, TIME], "required", parallel=True),
        "json_schema": json_grammar(SHAPE),
        "json_object": json_grammar(None),
        "auto": tool_call_grammar([WEATHER, TIME], "auto"),
    }
    sampling = SamplingParams(max_tokens=60)
    reference = None
    for engine in engines:
        grammar = engine.grammars.compile(texts[grammar_kind])
        prompt = engine.encode("What is the weather in Paris? The weather in Paris is")
        for spec in SPECS:
            out = engine.generate(prompt, sampling, spec, grammar=grammar)
            if reference is None:
                reference = out
            assert out.token_ids == reference.token_ids, (engine.max_batch, spec)
            if spec.forced_drafts and grammar_kind not in ("auto", "json_object"):
                assert out.stats.forced > 0
            if not spec.forced_drafts:
                assert out.stats.forced == 0
    if grammar_kind == "json_object":
        return  # a random model's free object may run to max_tokens
    if grammar_kind in ("json_schema",):
        assert json.loads(reference.text)["kind"] in ("a", "bb", "ccc")
    elif grammar_kind != "auto":
        parsed = parse_tool_calls(reference.text, {"get_weather", "get_time"})
        assert parsed.tool_calls and not parsed.malformed and parsed.content is None, reference.text
        assert reference.finish_reason == "stop"


def test_forced_drafts_cut_the_passes(engines):
    engine = engines[0]
    grammar = engine.grammars.compile(tool_call_grammar([WEATHER], "required", parallel=False))
    prompt = engine.encode("weather please")
    plain = engine.generate(prompt, SamplingParams(max_tokens=60), SpecConfig(forced_drafts=False), grammar=grammar)
    forced = engine.generate(prompt, SamplingParams(max_tokens=60), SpecConfig(), grammar=grammar)
    assert forced.token_ids == plain.token_ids
    assert forced.stats.forced >= 10  # the tags, the name, the keys, the enum's rest
    assert forced.stats.target_passes < plain.stats.target_passes - 5
    assert forced.stats.proposed == 0  # forced tokens are not the drafter's
    assert forced.stats.outcome().forced == forced.stats.forced


def _stream_logging_passes(engine, prompt, sampling, spec, grammar):
    """The stream's events, and a log of passes ("pass") and event texts in the order they came
    (exact for the serial engine, which runs in this thread)."""
    log: list[str] = []
    forward = engine.model.forward_rows
    engine.model.forward_rows = lambda *a, **k: (log.append("pass"), forward(*a, **k))[1]
    try:
        events = []
        for event in engine.stream(prompt, sampling, spec, grammar=grammar):
            log.append(event.text)
            events.append(event)
    finally:
        del engine.model.forward_rows
    return events, log


@pytest.mark.parametrize("which", [0, 1])  # serial, batching
def test_forced_tokens_stream_before_the_pass_that_verifies_them(engines, which):
    """A forced span (here the tool call's opening and name) is certain: its text goes out as
    its own event before the pass that verifies it, so a client sees the call's name a pass
    earlier. The streamed text is still the generated reply, token for token."""
    engine = engines[which]
    grammar = engine.grammars.compile(tool_call_grammar([WEATHER], "required", parallel=False))
    prompt, sampling = engine.encode("weather please"), SamplingParams(max_tokens=60)
    spec = SpecConfig(method="ngram", gamma=4)
    events, log = _stream_logging_passes(engine, prompt, sampling, spec, grammar)
    whole = engine.generate(prompt, sampling, spec, grammar=grammar)
    assert "".join(e.text for e in events) == whole.text
    assert [t for e in events for t in e.token_ids] == whole.token_ids
    constraint = grammar.constraint()
    constraint.advance(events[0].token_ids)
    opening = constraint.forced(16)
    assert '{"name": "get_weather", "arguments":' in engine.tokenizer.decode(opening)
    assert events[1].token_ids == opening  # on its own, not with what its pass accepted
    if which == 0:  # the serial engine runs in this thread: the order is exact
        before_second_pass = log[: [i for i, x in enumerate(log) if x == "pass"][1]]
        assert "get_weather" in "".join(before_second_pass)


@pytest.mark.parametrize("which", [0, 1])  # serial, batching
def test_forced_tokens_stream_early_with_stop_strings_too(engines, which):
    """Stop strings do not hold a forced span back: its tokens are certain, so a stop string it
    completes ends the reply there whatever the pass says (here '"rain"', inside the span after
    the first argument's value). Text, tokens and finish are those of the reply decoded without
    forced drafts."""
    engine = engines[which]
    grammar = engine.grammars.compile(tool_call_grammar([WEATHER], "required", parallel=False))
    prompt = engine.encode("weather please")
    for stop in (("</tool_call>",), ('"rain"',)):
        sampling = SamplingParams(max_tokens=60, stop=stop)
        events, _ = _stream_logging_passes(engine, prompt, sampling, SpecConfig(method="ngram", gamma=4), grammar)
        plain = engine.generate(prompt, sampling, SpecConfig(method="ngram", gamma=4, forced_drafts=False),
                                grammar=grammar)
        result = events[-1].result
        assert "".join(e.text for e in events) == plain.text == result.text
        assert result.token_ids == plain.token_ids and result.finish_reason == plain.finish_reason == "stop"
        constraint = grammar.constraint()
        constraint.advance(events[0].token_ids)
        assert events[1].token_ids == constraint.forced(16)  # previewed on its own
    assert plain.text.endswith('"unit": "celsius", ') or plain.text.endswith('"unit": "fahrenheit", ')


def test_sampled_constrained_replies_parse(engines):
    engine = engines[1]
    grammar = engine.grammars.compile(tool_call_grammar([WEATHER, TIME], "required", parallel=True))
    prompt = engine.encode("call a tool")
    for seed in range(5):
        out = engine.generate(prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=120),
                              SpecConfig(method="ngram", gamma=3), grammar=grammar)
        parsed = parse_tool_calls(out.text, {"get_weather", "get_time"})
        assert parsed.tool_calls and not parsed.malformed, out.text


class ForbiddenDrafter(Drafter):
    """Proposes a token the grammar never allows inside JSON (`<|im_start|>`), then more."""

    def __init__(self, token: int):
        self.token = token

    def propose(self, history, gamma, sampling, generator):
        return Proposal([self.token] * gamma)


def test_forbidden_drafts_end_the_draft_before_verification(engines):
    engine = engines[0]
    grammar = engine.grammars.compile(json_grammar(SHAPE))
    prompt = engine.encode("json")
    im_start = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    plain = engine.generate(prompt, SamplingParams(max_tokens=40), SpecConfig(), grammar=grammar)
    out = engine.generate(prompt, SamplingParams(max_tokens=40), SpecConfig(method="draft", gamma=4), grammar=grammar,
                          drafter=ForbiddenDrafter(im_start))
    assert out.token_ids == plain.token_ids
    assert out.stats.proposed == 0  # every draft was cut at its first token


def test_auto_grammar_takes_free_text_or_valid_calls_only(engines):
    engine = engines[0]
    constraint = engine.grammars.compile(tool_call_grammar([WEATHER], "auto", parallel=False)).constraint()
    good = engine.encode('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius", '
                         '"rain": true}}\n</tool_call>')
    n, masks = constraint.walk(good)
    assert n == len(good) and masks.shape[0] == len(good) + 1
    eos = sorted(engine.eos_token_ids)
    assert bool(masks[-1][eos].all())  # the call is complete: the reply may end
    wrong_name = engine.encode('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    n, _ = constraint.walk(wrong_name)
    assert n < len(wrong_name)
    text = engine.encode("Just an answer, no call.")
    n, masks = constraint.walk(text)
    assert n == len(text) and bool(masks[-1][eos].all())


def test_auto_grammar_forces_the_call_opening_once_the_tag_is_written(engines):
    """After free text and the open tag, the newline and the call's opening up to the (only)
    name are forced: drafted for free in one pass, not written one token per pass. What is not
    a call cannot follow the tag."""
    engine = engines[0]
    grammar = engine.grammars.compile(tool_call_grammar([WEATHER], "auto", parallel=False))
    constraint = grammar.constraint()
    constraint.advance(engine.encode("Let me look.<tool_call>"))
    assert engine.tokenizer.decode(constraint.forced(16)).startswith('\n{"name": "get_weather", "arguments": {')
    stray = engine.encode("<tool_call>then text")
    n, _ = grammar.constraint().walk(stray)
    assert n < len(stray)


class ScriptedDrafter(Drafter):
    """Proposes the given tokens, once."""

    name = "scripted"

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def propose(self, history, gamma, sampling, generator):
        tokens, self.tokens = self.tokens[:gamma], []
        return Proposal(tokens)


def test_a_draft_reaching_a_forced_span_carries_the_span(engines):
    """A draft the grammar allows to its end is followed by the tokens the grammar forces after
    it: here the rest of the tag after '<' and, once the tag is written, the call's opening and
    the only tool's name, verified in the same pass. Accepted, they count as forced tokens, not
    as the drafter's."""
    from openalice_runner.engine.kv_cache import KVCache
    from openalice_runner.engine.round import plan_round
    from openalice_runner.engine.sequence import SequenceRequest, Target, begin, new_sequence
    from openalice_runner.engine.settle import settle_round

    engine = engines[0]
    grammar = engine.grammars.compile(tool_call_grammar([WEATHER], "auto", parallel=False))
    prompt = engine.encode("weather please")
    opening = engine.encode("<tool_call>")
    rest_of_tag = opening[1:]
    seq = new_sequence(SequenceRequest(prompt, SamplingParams(max_tokens=60), SpecConfig(method="draft", gamma=8),
                                       ScriptedDrafter(rest_of_tag), grammar.constraint()),
                       Target(KVCache(engine.model.cfg, 1, 128, torch.float32), engine.tokenizer,
                              engine.eos_token_ids, 128))
    begin(seq)
    seq.tokens.append(opening[0])  # the reply so far: '<' (free text could go on from it)
    seq.constraint.advance(opening[:1])
    planned = plan_round(seq, 8)
    draft = planned.draft
    assert draft[: len(rest_of_tag)] == rest_of_tag and planned.forced == 0
    after = draft[len(rest_of_tag):]
    assert engine.tokenizer.decode(after).startswith('\n{"name": "get_weather", "arguments": {')
    assert planned.forced_after == len(after) and planned.masks.shape[0] == len(draft) + 1
    # the target agrees with every drafted token: all are accepted, then a bonus token
    logits = torch.full((len(draft) + 1, engine.model.cfg.vocab_size), -1.0)
    logits[torch.arange(len(draft)), torch.tensor(draft)] = 1.0
    logits[-1] = planned.masks[-1].float()[: logits.shape[1]]  # any allowed token
    assert planned.start == 0
    emitted = settle_round(seq, planned, logits, torch.zeros(len(draft) + 1, 1), 0.0)
    assert emitted[: len(draft)] == draft and len(emitted) == len(draft) + 1
    assert seq.stats.proposed == seq.stats.accepted == len(rest_of_tag)
    assert seq.stats.forced == len(after) and seq.stats.target_passes == 1


def test_grammar_errors_name_the_problem(engines):
    with pytest.raises(GrammarError):
        engines[0].grammars.compile("start: undefined_rule\n")
    assert engines[0].grammars.compile(json_grammar(SHAPE)) is engines[0].grammars.compile(json_grammar(SHAPE))


CALENDAR = {  # the workload's tool-calendar: its parameters say nothing of other keys
    "type": "function",
    "function": {
        "name": "create_event",
        "parameters": {"type": "object", "properties": {"title": {"type": "string"}, "start": {"type": "string"},
                                                         "attendees": {"type": "array", "items": {
                                                             "type": "object", "properties": {"email": {"type": "string"}}}}},
                       "required": ["title", "start"]},
    },
}


def test_arguments_name_only_the_declared_keys(engines):
    """A small model copies the schema's words in as extra keys until max_tokens cuts the call; the
    grammar closes objects whose schema says nothing of other keys (as OpenAI strict and xgrammar do)."""
    engine = engines[0]
    grammar = engine.grammars.compile(tool_call_grammar([CALENDAR], "required", parallel=False))

    def accepts(arguments: str) -> bool:
        ids = engine.encode(f'<tool_call>\n{{"name": "create_event", "arguments": {arguments}}}\n</tool_call>')
        n, masks = grammar.constraint().walk(ids)
        return n == len(ids) and bool(masks[-1][sorted(engine.eos_token_ids)].all())

    assert accepts('{"title": "x", "start": "y"}')
    assert accepts('{"title": "x", "start": "y", "attendees": [{"email": "a@b"}]}')
    assert not accepts('{"title": "x", "start": "y", "description": "ISO 8601"}')
    assert not accepts('{"title": "x", "start": "y", "attendees": [{"email": "a@b", "name": "A"}]}')


def test_closing_objects_only_narrows_the_schema():
    from openalice_runner.engine.grammar import closed_objects

    assert closed_objects(CALENDAR["function"]["parameters"])["additionalProperties"] is False
    stated = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}}
    assert closed_objects(stated) == stated
    composed = {"type": "object", "properties": {"a": {}}, "allOf": [{"properties": {"b": {}}}]}
    assert closed_objects(composed) == composed  # closing would forbid the b that allOf names
    requires_unnamed = {"type": "object", "properties": {"a": {}}, "required": ["b"]}
    assert closed_objects(requires_unnamed) == requires_unnamed
    negated = {"not": {"type": "object", "properties": {"a": {}}}}
    assert closed_objects(negated) == negated  # narrowing under `not` widens the whole
    nested = {"$defs": {"P": {"type": "object", "properties": {"x": {}}}}, "$ref": "#/$defs/P"}
    assert closed_objects(nested)["$defs"]["P"]["additionalProperties"] is False


@pytest.mark.parametrize("max_batch", [1, 4])
def test_forced_runs_fit_the_cache_at_a_granule_boundary(max_batch):
    """A round of forced tokens (up to 16) must have cache positions reserved, with speculation off
    too: a prompt ending a few positions below a 512-position granule failed with 'position N is
    beyond the cache' on the batching engine (bench-loops, the `off` target)."""
    grammar_text = tool_call_grammar([WEATHER], "required", parallel=False)
    for length in (494, 498, 502):
        engine = Engine.tiny_random(seed=0, max_batch=max_batch)  # a fresh cache of one granule
        grammar = engine.grammars.compile(grammar_text)
        base = engine.encode("weather please")
        prompt = (base * (length // len(base) + 1))[:length]
        forced = engine.generate(prompt, SamplingParams(max_tokens=40), SpecConfig(), grammar=grammar)
        plain = engine.generate(prompt, SamplingParams(max_tokens=40), SpecConfig(forced_drafts=False), grammar=grammar)
        assert forced.token_ids == plain.token_ids and forced.stats.forced >= 10
