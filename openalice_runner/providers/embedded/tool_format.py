"""Tool calling for models served by the embedded engine: prompt rendering and output parsing.

Two cases:
- The model's chat template renders tools itself (its Jinja source mentions `tools`, e.g. Qwen2.5,
  Hermes, Llama 3.1): messages and tools go to the template unchanged.
- It does not (SmolLM2-135M-Instruct's template has no tool support). Then the **fallback form**,
  the Hermes convention that many open models were trained on, is rendered into plain messages:
    * a system block lists each tool as one JSON line inside <tools></tools> and asks for
      `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call;
    * an assistant message's tool calls become those blocks after its text;
    * tool results become one user message, a line "The NAME tool returned: CONTENT" per result
      (consecutive results merged), since such templates know no `tool` role. Plain words, not
      Hermes' <tool_response> tags: SmolLM2 echoes the tags back instead of answering from them.

Output is parsed the same way in both cases: every <tool_call> block whose JSON is an object with
a string `name` (one of the offered tools) and object `arguments` becomes a ToolCall with
canonical JSON arguments; anything else stays content. Parsing never raises.

The system block is the same whatever `tool_choice` says, "none" included: an agent loop sends its
history again with every call, and the engine reuses the cache of the previous call's prompt and
reply only as far as the new prompt starts with them; a loop that forces its first call and not
the next must not change its system prompt. So the block states only the default ("auto") rule,
and each call's own rule goes where it applies, after the history the next call resends:
- "required" or a named function: an assistant *prefill*, the opening of a tool call block that
  the prompt ends with, so that even a weak model writes the call in the expected form (the
  prefill is part of the text that is parsed, and the call it opens is what the history renders
  back as the assistant's message: the next call's prompt still starts with this one's);
- "none": a short line in the final turn (`with_turn_rule`), the only per-call text; the call
  after it prefills this call's reply again, which a loop's closing answer rarely needs.
On the embedded engine the grammar enforces the rule in any case; the words help a small model
write what the grammar allows.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from openalice_runner.types import FunctionCall, NamedToolChoice, ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_SYSTEM_TEMPLATE = (
    "You can call functions to help with the user's request. The functions are listed below, "
    "one JSON signature per line, inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, reply with a JSON object holding the function name and its arguments "
    "inside <tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{{"name": "<function-name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>\n'
    "Call a function only when it helps; otherwise answer directly."
)
RULE_NONE = "Answer directly now, without calling a function."


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether a Jinja chat template uses the `tools` variable (then it renders them itself)."""
    return chat_template is not None and re.search(r"\btools\b", chat_template) is not None


# ---------------------------------------------------------------- rendering (fallback form)


def tools_system_block(tools: list[dict[str, Any]]) -> str:
    """The tools and the call format, with the default rule; the same for every tool_choice."""
    lines = "\n".join(json.dumps(_signature(t), ensure_ascii=False) for t in tools)
    return _SYSTEM_TEMPLATE.format(tools=lines)


def with_turn_rule(messages: list[dict[str, Any]], tool_choice: Any) -> list[dict[str, Any]]:
    """`messages` with the call's own tool_choice rule in the final turn, where one is stated in
    words ("none"; "required" and a named function are stated by the prefill, "auto" by the
    tools block). Callers apply it only to a request that offers tools: without tools, the
    effective "none" has nothing to state.

    Appended to the last user message (tool results rendered as one, in the fallback form), else
    as a user message of its own: templates that want roles to alternate keep them alternating."""
    if tool_choice != "none":
        return messages
    out = list(messages)
    last = out[-1] if out else None
    if last is not None and last["role"] == "user" and isinstance(last.get("content"), str):
        out[-1] = {**last, "content": f"{last['content']}\n\n{RULE_NONE}" if last["content"] else RULE_NONE}
    else:
        out.append({"role": "user", "content": RULE_NONE})
    return out


def _signature(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function", tool)
    sig: dict[str, Any] = {"name": fn["name"]}
    if fn.get("description"):
        sig["description"] = fn["description"]
    sig["parameters"] = fn.get("parameters") or {"type": "object", "properties": {}}
    return sig


def format_tool_call(name: str, arguments: Any) -> str:
    """One call block, as the model is asked to write it."""
    if isinstance(arguments, str):
        # Unparseable arguments stay raw text: that is what the model wrote.
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments) if arguments.strip() else {}
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def render_fallback_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    tool_choice: Any = "auto",
) -> list[dict[str, Any]]:
    """Rewrite OpenAI messages (+ tools) into plain system/user/assistant messages.

    The tools are listed for every tool_choice, "none" included (OpenAI too keeps them in the
    model's prompt then): hiding them would change the system block, and with it the prefix of
    the whole history, for one call. The call's own rule goes into the final turn (with_turn_rule)."""
    out: list[dict[str, Any]] = []
    block = tools_system_block(tools) if tools else None
    pending_results: list[str] = []
    call_names: dict[str, str] = {}  # tool_call_id -> function name, from the assistant turns

    def flush_results() -> None:
        if pending_results:
            out.append({"role": "user", "content": "\n".join(pending_results)})
            pending_results.clear()

    for i, msg in enumerate(messages):
        role = msg["role"]
        content = msg.get("content") or ""
        if role == "tool":
            name = call_names.get(msg.get("tool_call_id") or "", "function")
            pending_results.append(f"The {name} tool returned: {content}")
            continue
        flush_results()
        if role in ("system", "developer"):
            if block is not None and i == 0:
                content = f"{content}\n\n{block}" if content else block
                block = None
            out.append({"role": "system", "content": content})
        elif role == "assistant":
            parts = [content] if content else []
            for tc in msg.get("tool_calls") or []:
                fn = tc["function"]
                call_names[tc.get("id", "")] = fn["name"]
                parts.append(format_tool_call(fn["name"], fn.get("arguments", "{}")))
            out.append({"role": "assistant", "content": "\n".join(parts)})
        else:
            out.append({"role": role, "content": content})
    flush_results()
    if block is not None:  # no leading system message: the tools block becomes one
        out.insert(0, {"role": "system", "content": block})
    return with_turn_rule(out, tool_choice) if tools else out


def render_ids(renderer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """Prompt ids as the embedded provider renders a call to `renderer` (the engine's `render_chat`),
    tools and tool history in the template's form or the fallback one; without a call's tool_choice
    rule, prefill or grammar (what benchmarks and draft training need: the conversation itself)."""
    has_tool_history = any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
    if not tools and not has_tool_history:
        return renderer.render_chat(messages)
    template = getattr(getattr(renderer, "tokenizer", None), "chat_template", None)
    if template_renders_tools(template if isinstance(template, str) else None):
        return renderer.render_chat(template_messages(messages), tools)
    return renderer.render_chat(render_fallback_messages(messages, tools))


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that renders tools: arguments as objects (what such templates expect)."""
    out = []
    for msg in messages:
        if msg.get("tool_calls"):
            msg = dict(msg)
            calls = []
            for tc in msg["tool_calls"]:
                fn = dict(tc["function"])
                with contextlib.suppress(json.JSONDecodeError, TypeError):
                    fn["arguments"] = json.loads(fn.get("arguments") or "{}")
                calls.append({**tc, "function": fn})
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def assistant_prefill(tool_choice: Any, tools: list[dict[str, Any]] | None = None) -> str:
    """Text the assistant turn starts with, to pin the output format when a call is required.
    It is how the prompt states "required" and a named function (the system block is the same for
    every tool_choice), and it is the opening of the call the next call's history renders back.

    For a named function whose schema requires arguments, the prefill also opens the arguments
    object with the first required key (and the quote of a string value): small models otherwise
    tend to copy the JSON schema instead of filling it. The value, and anything after it, is the
    model's own.
    """
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        prefill = f'{TOOL_CALL_OPEN}\n{{"name": "{name}", "arguments": '
        return prefill + _first_argument_opening(name, tools or [])
    if tool_choice == "required":
        return f'{TOOL_CALL_OPEN}\n{{"name": "'
    return ""


def _first_argument_opening(name: str, tools: list[dict[str, Any]]) -> str:
    fn = next((t.get("function", t) for t in tools if t.get("function", t).get("name") == name), None)
    params = (fn or {}).get("parameters") or {}
    required = params.get("required") or []
    props = params.get("properties") or {}
    if not required or required[0] not in props:
        return ""
    key = required[0]
    opening = "{" + json.dumps(key) + ": "
    return opening + '"' if props[key].get("type") == "string" else opening


# ---------------------------------------------------------------- parsing


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)  # call blocks that did not parse


_DECODER = json.JSONDecoder()


def parse_tool_calls(text: str, tool_names: set[str] | None = None) -> ParsedOutput:
    """Split model output into content and tool calls. Never raises.

    A block is `<tool_call>` JSON-object `</tool_call>`; the closing tag may be missing at the end
    of the output (generation stopped on it). Text after a valid object inside a block is ignored.
    A block that does not hold a valid call (bad JSON, no name, unknown tool, non-object arguments)
    is kept verbatim in the content and listed in `malformed`.
    """
    if TOOL_CALL_OPEN not in text:
        return ParsedOutput(content=text)
    calls: list[ToolCall] = []
    malformed: list[str] = []
    kept: list[str] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            kept.append(text[pos:])
            break
        kept.append(text[pos:start])
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        block_end = len(text) if end < 0 else end + len(TOOL_CALL_CLOSE)
        body = text[body_start : len(text) if end < 0 else end]
        call = _parse_call(body, tool_names)
        if call is None:
            malformed.append(text[start:block_end])
            kept.append(text[start:block_end])
        else:
            calls.append(call)
        pos = block_end
        if end < 0:
            break
    content = "".join(kept).strip()
    return ParsedOutput(content=content or None, tool_calls=calls, malformed=malformed)


def without_blocks(parsed: ParsedOutput) -> str | None:
    """The content with its malformed call blocks left out (a grammar-constrained reply cut inside one)."""
    content = parsed.content or ""
    for block in parsed.malformed:
        content = content.replace(block, "", 1)
    return content.strip() or None


def _parse_call(body: str, tool_names: set[str] | None) -> ToolCall | None:
    stripped = body.strip()
    if not stripped.startswith("{"):
        return None
    try:
        obj, _ = _DECODER.raw_decode(stripped)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(name, str) or not isinstance(args, dict):
        return None
    if tool_names is not None and name not in tool_names:
        return None
    try:
        function = FunctionCall(name=name, arguments=json.dumps(args, ensure_ascii=False))
    except ValueError:  # a name OpenAI would not accept
        return None
    return ToolCall(id=new_call_id(), function=function)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def could_start_tool_call(tail: str) -> int:
    """Length of the longest suffix of `tail` that is a prefix of the open tag (stream hold-back)."""
    for n in range(min(len(tail), len(TOOL_CALL_OPEN)), 0, -1):
        if TOOL_CALL_OPEN.startswith(tail[-n:]):
            return n
    return 0
