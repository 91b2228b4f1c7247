"""Tool-call prompt rendering and output parsing, without a model."""

from __future__ import annotations

import json

from openalice_runner.providers.embedded import tool_format as tf
from openalice_runner.types import NamedToolChoice

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]
NAMES = {"get_weather", "get_time"}


def test_valid_call_is_parsed_with_canonical_json_arguments():
    out = tf.parse_tool_calls(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>', NAMES
    )
    assert out.content is None and out.malformed == []
    (call,) = out.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_") and call.type == "function"


def test_several_calls_and_surrounding_text():
    text = (
        "Let me check.\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    out = tf.parse_tool_calls(text, NAMES)
    assert [c.function.name for c in out.tool_calls] == ["get_weather", "get_time"]
    assert out.content == "Let me check."
    assert len({c.id for c in out.tool_calls}) == 2


def test_malformed_blocks_stay_content_and_never_raise():
    cases = [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not an offered tool
        '<tool_call>{"name": "get_time", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>["get_time"]</tool_call>',
        "<tool_call>",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',  # cut off mid-JSON
    ]
    for text in cases:
        out = tf.parse_tool_calls(text, NAMES)
        assert out.tool_calls == [], text
        assert out.content == text.strip(), text
        assert out.malformed, text


def test_one_good_one_bad():
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>'
    out = tf.parse_tool_calls(text, NAMES)
    assert [c.function.name for c in out.tool_calls] == ["get_time"]
    assert out.content == "<tool_call>{oops}</tool_call>"


def test_missing_close_tag_and_trailing_garbage():
    out = tf.parse_tool_calls('<tool_call>\n{"name": "get_time", "arguments": {}} and then more', NAMES)
    assert [c.function.name for c in out.tool_calls] == ["get_time"]


def test_double_encoded_arguments_are_accepted():
    out = tf.parse_tool_calls(
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>', NAMES
    )
    assert json.loads(out.tool_calls[0].function.arguments) == {"city": "Rome"}


def test_plain_text_passes_through():
    assert tf.parse_tool_calls("just words", NAMES).content == "just words"
    assert tf.parse_tool_calls("", NAMES).content == ""


def test_fallback_rendering_of_a_tool_conversation():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]
    out = tf.render_fallback_messages(messages, TOOLS, "auto")
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and "<tools>" in out[0]["content"]
    assert '"name": "get_weather"' in out[0]["content"] and "Weather for a city" in out[0]["content"]
    assert out[2]["content"].count("<tool_call>") == 2
    parsed = tf.parse_tool_calls(out[2]["content"], NAMES)  # what we render, we parse back
    assert [json.loads(c.function.arguments)["city"] for c in parsed.tool_calls] == ["Paris", "Rome"]
    assert out[3]["content"] == "The get_weather tool returned: sunny\nThe get_weather tool returned: rain"


NAMED = NamedToolChoice(function={"name": "get_weather"})
CHOICES = ["auto", "required", NAMED, "none"]


def test_fallback_without_system_message_adds_one():
    out = tf.render_fallback_messages([{"role": "user", "content": "hi"}], TOOLS, "required")
    assert out[0]["role"] == "system" and "<tools>" in out[0]["content"]
    assert out[1] == {"role": "user", "content": "hi"}


def test_the_system_block_is_the_same_for_every_tool_choice():
    """A loop that forces one call and not the next must keep its prompt's prefix (prefix reuse):
    the tools stay listed, "none" included, and the block states only the default rule."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    systems = [tf.render_fallback_messages(messages, TOOLS, c)[0] for c in CHOICES]
    assert all(s == systems[0] for s in systems)
    block = systems[0]["content"]
    assert block.startswith("Be brief.") and '"name": "get_weather"' in block and '"name": "get_time"' in block
    assert "Call a function only when it helps; otherwise answer directly." in block  # "auto"'s rule
    assert tf.RULE_NONE not in block and "must" not in block


def test_each_tool_choice_rule_is_stated_after_the_history():
    messages = [{"role": "user", "content": "hi"}]
    # "auto": the tools block's default rule, nothing after the history
    assert tf.render_fallback_messages(messages, TOOLS, "auto")[1:] == messages
    # "required" and a named function: the prefill opens the call the rule asks for, and nothing
    # is added to the history (what the model writes after it is rendered back as its message)
    assert tf.render_fallback_messages(messages, TOOLS, "required")[1:] == messages
    assert tf.render_fallback_messages(messages, TOOLS, NAMED)[1:] == messages
    assert tf.assistant_prefill("required") == '<tool_call>\n{"name": "'
    assert tf.assistant_prefill(NAMED).startswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    # "none": one line in the final turn: the last user message, here the tool results
    out = tf.render_fallback_messages(messages, TOOLS, "none")
    assert out[1] == {"role": "user", "content": f"hi\n\n{tf.RULE_NONE}"} and len(out) == 2
    assert "without calling a function" in tf.RULE_NONE and tf.assistant_prefill("none") == ""
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    loop = [*messages, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    out = tf.render_fallback_messages(loop, TOOLS, "none")
    assert out[-1] == {"role": "user", "content": f"The get_time tool returned: noon\n\n{tf.RULE_NONE}"}
    # after an assistant message, or for a template's `tool` message: a user message of its own
    assert tf.with_turn_rule(loop, "none")[-1] == {"role": "user", "content": tf.RULE_NONE}
    assert tf.with_turn_rule(loop, "auto") == loop and tf.with_turn_rule(loop, NAMED) == loop
    # without tools there is no rule to state, whatever the choice
    assert tf.render_fallback_messages(messages, None, "none") == messages


def test_a_forced_call_rendered_back_continues_its_prompt():
    """Call 1 forces a call (its prompt ends with the prefill and the model writes the rest); call 2
    sends it back as the assistant's tool call, with the result, under another tool_choice. Call
    2's rendering starts with call 1's prompt text and reply text (what prefix reuse needs)."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Lima?"}]

    def text(rendered):  # a ChatML-like template: turn by turn
        return "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in rendered)

    for first in ("required", NAMED):
        prefill = tf.assistant_prefill(first, TOOLS)
        reply = tf.format_tool_call("get_weather", '{"city": "Lima"}')[len(prefill):]
        assert reply and prefill + reply == tf.format_tool_call("get_weather", {"city": "Lima"})
        prompt_1 = text(tf.render_fallback_messages(messages, TOOLS, first)) + "<|assistant|>\n" + prefill
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}
        loop = [*messages, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
        for second in CHOICES:
            assert text(tf.render_fallback_messages(loop, TOOLS, second)).startswith(prompt_1 + reply), (first, second)


def test_prefill_pins_the_format():
    named = NamedToolChoice(function={"name": "get_weather"})
    assert tf.assistant_prefill(named) == '<tool_call>\n{"name": "get_weather", "arguments": '
    # With the schema at hand, the first required key is opened too (the value is the model's).
    assert tf.assistant_prefill(named, TOOLS).endswith('"arguments": {"city": "')
    time_call = NamedToolChoice(function={"name": "get_time"})
    assert tf.assistant_prefill(time_call, TOOLS).endswith('"arguments": ')
    assert tf.assistant_prefill("required").startswith("<tool_call>")
    assert tf.assistant_prefill("auto") == ""
    # The prefill plus a good continuation parses.
    out = tf.parse_tool_calls(tf.assistant_prefill(named) + '{"city": "Lima"}}\n</tool_call>', NAMES)
    assert json.loads(out.tool_calls[0].function.arguments) == {"city": "Lima"}


def test_template_detection():
    assert not tf.template_renders_tools("{% for message in messages %}{{ message['content'] }}{% endfor %}")
    assert tf.template_renders_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not tf.template_renders_tools(None)


def test_stream_hold_back_prefix():
    assert tf.could_start_tool_call("hello <tool") == 5
    assert tf.could_start_tool_call("hello <") == 1
    assert tf.could_start_tool_call("hello") == 0
