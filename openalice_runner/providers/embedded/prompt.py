"""A local request's prompt: its token ids, the assistant text it ends with, the tools it may call and
the grammar its reply follows; and the bounds that refuse what the model's context cannot serve.

The rendering and tokenizing are the engine's, reached through a `ChatRenderer` that providers/local.py
hands in (the engine itself): only local.py imports the engine."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from openalice_runner.providers.base import ProviderBadRequest
from openalice_runner.providers.embedded import grammar as reply_grammars
from openalice_runner.providers.embedded import tool_format
from openalice_runner.types import AllowedToolChoice, ChatRequest


@dataclass
class Prompt:
    ids: list[int]
    prefill: str  # assistant text the prompt already ends with (part of the parsed output)
    tool_names: set[str] | None  # None: do not parse tool calls
    grammar: Any = None  # the engine's compiled Grammar the reply must follow (None: free)
    budget: int | None = None  # the max_tokens the reply runs under, clamped to the context (ContextBounds.budget)
    # seconds its building took by part (template, tokenize, grammar; first_token.py's names)
    times: dict[str, float] = field(default_factory=dict)


class ChatRenderer(Protocol):
    """What building a prompt needs of the engine: its chat template and its tokenizer."""

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]: ...

    def encode(self, text: str) -> list[int]: ...


class _TimedRenderer:
    """A renderer whose template and tokenizing times add up in `times` (template and tokenize apart
    where the engine renders text on its own, `chat_text`; else all under template)."""

    def __init__(self, engine: ChatRenderer) -> None:
        self.engine = engine
        self.times = {"template": 0.0, "tokenize": 0.0}

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        chat_text = getattr(self.engine, "chat_text", None)
        t0 = time.perf_counter()
        if chat_text is None:
            ids = self.engine.render_chat(messages, tools)
            self.times["template"] += time.perf_counter() - t0
            return ids
        text = chat_text(messages, tools)
        t1 = time.perf_counter()
        ids = self.engine.encode(text)
        self.times["template"] += t1 - t0
        self.times["tokenize"] += time.perf_counter() - t1
        return ids

    def encode(self, text: str) -> list[int]:
        t0 = time.perf_counter()
        ids = self.engine.encode(text)
        self.times["tokenize"] += time.perf_counter() - t0
        return ids


def build_prompt(
    request: ChatRequest,
    engine: ChatRenderer,
    backend: reply_grammars.GrammarBackend,
    *,
    renders_tools: bool,
    provider: str,
) -> Prompt:
    """`renders_tools`: the model's chat template renders the tools itself (else tool_format's
    fallback messages do). The prompt's `times` say what its template, tokenizing and grammar took."""
    engine = timed = _TimedRenderer(engine)
    messages = request.message_dicts()
    choice = request.effective_tool_choice
    # The tools are rendered whatever tool_choice says, "none" included, and the call's own
    # rule after the history (tool_format): the prompt's prefix, and with it the cache a
    # loop's next call reuses, does not depend on tool_choice. The grammar enforces the rule.
    tools = request.tool_dicts()
    # allowed_tools alike: every tool is rendered, only the allowed ones are callable (grammar,
    # prefill, parsing); its mode acts as the plain "auto"/"required"
    callable_tools = tools
    if isinstance(choice, AllowedToolChoice):
        allowed = set(choice.allowed_tools.names)
        callable_tools = [t for t in tools or () if t["function"]["name"] in allowed]
        choice = choice.allowed_tools.mode
    history_has_tools = any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if renders_tools:
        shown = tool_format.with_turn_rule(messages, choice) if tools else messages
        ids = engine.render_chat(tool_format.template_messages(shown), tools)
    elif tools or history_has_tools:
        ids = engine.render_chat(tool_format.render_fallback_messages(messages, tools, choice))
    else:
        ids = engine.render_chat(messages)
    t0 = time.perf_counter()
    grammar = reply_grammars.reply_grammar(request, callable_tools, choice, backend, provider)
    # A forced call's opening is pre-filled (the grammar would force it anyway; a weak model
    # also gets the first argument's key), and the grammar starts after it.
    prefill = tool_format.assistant_prefill(choice, callable_tools) if tools else ""
    if prefill and grammar is not None:
        prefill, grammar = reply_grammars.prefill_within(grammar, prefill, choice, backend)
    grammar_s = time.perf_counter() - t0
    if prefill:
        ids = list(ids) + engine.encode(prefill)
    names = {t["function"]["name"] for t in callable_tools or ()} if tools and choice != "none" else None
    times = {**timed.times, "grammar": grammar_s}
    return Prompt(ids=list(ids), prefill=prefill, tool_names=names, grammar=grammar, times=times)


_FRAMED_ROLES = ("system", "user", "assistant")  # the roles message_overhead measures


def _measured_overhead(renderer: Callable[[], ChatRenderer]) -> dict[str, int]:
    try:
        engine = renderer()
        base = [{"role": "user", "content": "x"}]
        alone = len(engine.render_chat(base))
    except Exception:  # no template at all: count nothing rather than refuse what might fit
        return {}
    out = {}
    for role in _FRAMED_ROLES:
        try:  # some templates refuse, e.g., a system message after a user's
            added = len(engine.render_chat([*base, {"role": role, "content": ""}])) - alone
        except Exception:  # noqa: S112 - a role the template refuses is not counted
            continue
        out[role] = max(0, added - 2)
    return out


class ContextBounds:
    """What the model's context refuses: cheap bounds before a request queues (`precheck`), then its
    prompt's length and its budget once the prompt is built. `context_length`: the model's, None
    while the engine is not loaded (nothing to check against); `tokenizer`: the engine's.

    A max_tokens past the context is not refused but clamped (`budget`): agent runtimes send budgets
    sized for hosted models (Claude Code and opencode: 32,000) whatever model serves them, and the
    reply can never be longer than the context leaves anyway (docs/agent-runtimes.md, "Budget")."""

    def __init__(
        self,
        provider: str,
        context_length: Callable[[], int | None],
        tokenizer: Callable[[], Any],
        renderer: Callable[[], ChatRenderer] | None = None,
    ) -> None:
        self.provider = provider
        self._context_length = context_length
        self._tokenizer = tokenizer
        self._renderer = renderer  # the chat template, for the tokens each message costs (None: not counted)
        self._longest: int | None = None  # the vocabulary's longest token, in characters
        self._overhead: dict[str, int] | None = None  # role -> tokens the template adds around one, at least

    def precheck(self, request: ChatRequest) -> None:
        """A prompt that cannot fit in the context by a count that renders and tokenizes nothing: its
        characters at the longest token the vocabulary has, plus the tokens the chat template adds
        around each message at least. Counting characters alone let 254,000 empty messages (8 MB)
        through to a 9 s, 900 MB render before the refusal. max_tokens is not checked here: `budget`
        clamps it."""
        context = self._context_length()
        if context is None:
            return
        chars = sum(len(m.text) for m in request.messages)
        if chars > context * self.longest_token_chars():
            raise ProviderBadRequest(
                f"the messages hold {chars} characters, more than the model's context of {context} "
                "tokens can take", provider=self.provider, param="messages", code="context_length_exceeded",
            )  # fmt: skip
        overhead = self.message_overhead()
        least = sum(overhead.get(m.role, 0) for m in request.messages) + -(-chars // self.longest_token_chars())
        if least >= context:
            raise ProviderBadRequest(
                f"the {len(request.messages)} messages take at least {least} tokens (the chat template's "
                f"own around each, and their text), and the model's context is {context} tokens",
                provider=self.provider, param="messages", code="context_length_exceeded",
            )  # fmt: skip

    def message_overhead(self) -> dict[str, int]:
        """Tokens the chat template adds around one message of each role, at least: what one more
        empty message of the role adds to a rendered conversation, less two (the template's text on
        either side of a message's content may merge with it into fewer tokens). Measured on first
        use, for system, user and assistant (tool messages may be folded into others: not counted);
        none without a renderer, or for a role the template refuses in the probe."""
        if self._overhead is None:
            self._overhead = _measured_overhead(self._renderer) if self._renderer is not None else {}
        return self._overhead

    def longest_token_chars(self) -> int:
        if self._longest is None:
            tokenizer = self._tokenizer()
            try:
                longest = max(len(t) for t in tokenizer.get_vocab())
            except Exception:  # a tokenizer without a vocabulary listing: a generous bound
                longest = 64
            self._longest = max(1, longest)
        return self._longest

    def check_prompt(self, prompt: Prompt) -> None:
        context = self._context_length()
        if context is not None and len(prompt.ids) >= context:
            raise ProviderBadRequest(
                f"the prompt has {len(prompt.ids)} tokens; the model's context is {context} tokens "
                "and at least one must be left for the reply",
                provider=self.provider, param="messages", code="context_length_exceeded",
            )  # fmt: skip

    def budget(self, prompt: Prompt, max_tokens: int) -> int:
        """The reply's budget: max_tokens, at most what the context leaves after the prompt
        (prompt tokens + budget <= context). `check_prompt` first: at least one token is left."""
        context = self._context_length()
        return max_tokens if context is None else max(1, min(max_tokens, context - len(prompt.ids)))

    def check_budget(self, prompt: Prompt, max_tokens: int, shortest_reply: Callable[[Any, int], int | None]) -> None:
        """Refuse a budget below the shortest reply the grammar accepts (`shortest_reply`,
        engine/closing.py's): the reply could not end valid within it."""
        if prompt.grammar is None:
            return
        context = self._context_length()
        room = max_tokens if context is None else min(max_tokens, context - len(prompt.ids))
        need = shortest_reply(prompt.grammar, room)
        if need is not None and need > room:
            where = "max_tokens" if room == max_tokens else "the context left after the prompt"
            raise ProviderBadRequest(
                f"max_tokens is {max_tokens}, below the minimum the schema needs: its shortest "
                f"valid reply takes {need} tokens here ({where} allows {room})",
                provider=self.provider, param="max_tokens", code="invalid_value",
            )  # fmt: skip
