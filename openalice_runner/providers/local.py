"""Local provider: the embedded engine (torch, CPU), with tool calling through the prompt.

The engine is synchronous and serialises requests; this provider runs it in a worker thread so the
event loop stays free and counts requests in flight (its load). How many may run and queue is the
admission gate's business (providers/wrappers/admission.py), in front of this provider. Requests the model
can never serve (a prompt longer than its context, max_tokens past it) are refused before they
reach the engine. Tool prompts and parsing live in tool_format.py. The policy's SpeculationPlan becomes the
request's SpecConfig; a method the engine cannot run is downgraded to "off" and the result says so.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Literal

from openalice_runner.engine.errors import InvalidRequest
from openalice_runner.engine.histories import ConversationHistories, align_prompt
from openalice_runner.engine.types import EngineOverloaded, SamplingParams, SpecConfig
from openalice_runner.providers.base import (
    CallContext,
    Capabilities,
    Provider,
    ProviderBadRequest,
    ProviderError,
    ProviderInternalError,
    ProviderLoad,
    ProviderRateLimited,
    StreamBroken,
)
from openalice_runner.providers.embedded import tool_format
from openalice_runner.providers.embedded.local_config import LocalConfig
from openalice_runner.providers.embedded.tool_stream import ToolCallStream
from openalice_runner.providers.streams import ChatStream, chat_stream
from openalice_runner.speculation import SPEC_METHODS, SpeculationPlan
from openalice_runner.types import (
    AllowedToolChoice,
    ChatChunk,
    ChatRequest,
    ChatResult,
    ChunkChoice,
    NamedToolChoice,
    SamplingSettings,
    SpeculationInfo,
    ToolCall,
    Usage,
    new_id,
)

logger = logging.getLogger(__name__)

ENGINE_SPEC_METHODS = frozenset(SPEC_METHODS)


@dataclass
class _Prompt:
    ids: list[int]
    prefill: str  # assistant text the prompt already ends with (part of the parsed output)
    tool_names: set[str] | None  # None: do not parse tool calls
    grammar: Any = None  # the engine's compiled Grammar the reply must follow (None: free)


class LocalProvider(Provider):
    kind = "local"
    gen_ai_provider_name = "openalice"

    def __init__(self, name: str, config: LocalConfig, engine: Any = None) -> None:
        self.name = name
        self.config = config
        self.capabilities = Capabilities(tools=True, streaming=True, spec_methods=ENGINE_SPEC_METHODS)
        self._engine = engine
        self._engine_lock = threading.Lock()
        self._in_flight = 0
        self._template_tools: bool | None = None
        self._max_token_chars: int | None = None
        self._kv_tokens = 0  # KV positions held by running generations (back to 0 when they end)
        self._kv_lock = threading.Lock()  # worker threads update it
        self._unusable_heads: set[str | None] = set()  # eagle heads already reported as not loading
        self._refused_rules: set[str | None] = set()  # policy rules already reported as not runnable
        self._histories = ConversationHistories()  # conversation id -> its last call's token ids
        self.warm_up_s: float | None = None  # how long the start-up's warm-up call took (None: not run)

    # ---- engine ----

    @property
    def engine(self) -> Any:
        """The engine, loaded on first use (a real model takes seconds to load)."""
        if self._engine is None:
            with self._engine_lock:
                if self._engine is None:
                    from openalice_runner.engine import Engine

                    cfg = self.config
                    kv_bytes = None if cfg.kv_cache_mib is None else cfg.kv_cache_mib * 2**20
                    if cfg.tiny_random:
                        self._engine = Engine.tiny_random(max_batch=cfg.max_batch, prefix_reuse=cfg.prefix_reuse,
                                                          kv_cache_bytes=kv_bytes)
                    else:
                        engine = Engine.load(
                            cfg.model, dtype=cfg.dtype, threads=cfg.threads, max_batch=cfg.max_batch,
                            prefix_reuse=cfg.prefix_reuse, kv_cache_bytes=kv_bytes, prefill=cfg.prefill,
                        )
                        engine.time_passes()  # drafts are sized from the first request on
                        engine.grammars  # noqa: B018 - the tokenizer's grammar tables (~2 s), before the first request
                        self._engine = engine
        return self._engine

    async def ensure_loaded(self) -> None:
        await asyncio.to_thread(lambda: self.engine)
        if self.config.warm_up if self.config.warm_up is not None else not self.config.tiny_random:
            await asyncio.to_thread(self.warm_up)

    def warm_up(self) -> float:
        """One short grammar-constrained call through the whole path (prompt, tool grammar, prefill,
        constrained decode), so that what the first request of a kind initialises (llguidance's
        matcher and lexer, the kernels' first passes) is paid at start-up, before `serve` takes
        traffic. Returns its seconds (also `warm_up_s`); runs once."""
        if self.warm_up_s is not None:
            return self.warm_up_s
        t0 = time.perf_counter()
        request = ChatRequest.model_validate({
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [{"type": "function", "function": {
                "name": "get_weather", "description": "Current weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            }}],
            "max_tokens": 8, "temperature": 0,
        })  # fmt: skip
        self._generate(request, CallContext(turn_type="tool_call"), threading.Event())
        self.warm_up_s = time.perf_counter() - t0
        logger.info("%s: warmed up in %.2f s (prefill: %s)", self.name, self.warm_up_s,
                    getattr(self.engine, "prefill", None))
        return self.warm_up_s

    @property
    def model_names(self) -> list[str]:
        if self._engine is not None:
            return [self._engine.model_name]
        return [self.config.model or "SmolLM2-135M-Instruct"]

    def load(self) -> ProviderLoad:
        scheduler = getattr(self._engine, "scheduler", None)
        if scheduler is not None:  # the batching engine knows its batch and its waiting line
            running, waiting = scheduler.load
            return ProviderLoad(batch_size=running, queue_depth=waiting)
        return ProviderLoad(batch_size=self._in_flight, queue_depth=max(0, self._in_flight - 1))

    @property
    def kv_tokens_in_use(self) -> int:
        return self._kv_tokens

    # ---- refusing what the model cannot serve ----

    def _context_length(self) -> int | None:
        engine = self._engine  # not loaded yet: nothing to check against
        return getattr(engine, "context_length", None) if engine is not None else None

    def precheck(self, request: ChatRequest) -> None:
        """Cheap bounds before queueing: max_tokens against the context, and a prompt whose characters
        cannot fit in the context even at the longest token the vocabulary has (no tokenizing)."""
        context = self._context_length()
        if context is None:
            return
        if request.max_tokens is not None and request.max_tokens >= context:
            raise ProviderBadRequest(
                f"max_tokens is {request.max_tokens}; the model's context is {context} tokens",
                provider=self.name, param="max_tokens", code="invalid_value",
            )  # fmt: skip
        chars = sum(len(m.text) for m in request.messages)
        if chars > context * self._longest_token_chars():
            raise ProviderBadRequest(
                f"the messages hold {chars} characters, more than the model's context of {context} "
                "tokens can take", provider=self.name, param="messages", code="context_length_exceeded",
            )  # fmt: skip

    def _longest_token_chars(self) -> int:
        if self._max_token_chars is None:
            tokenizer = self.engine.tokenizer
            try:
                longest = max(len(t) for t in tokenizer.get_vocab())
            except Exception:  # a tokenizer without a vocabulary listing: a generous bound
                longest = 64
            self._max_token_chars = max(1, longest)
        return self._max_token_chars

    def _check_prompt(self, prompt: _Prompt, sampling: Any) -> None:
        context = self._context_length()
        if context is not None and len(prompt.ids) >= context:
            raise ProviderBadRequest(
                f"the prompt has {len(prompt.ids)} tokens; the model's context is {context} tokens "
                "and at least one must be left for the reply",
                provider=self.name, param="messages", code="context_length_exceeded",
            )  # fmt: skip

    def _check_budget(self, prompt: _Prompt, sampling: Any) -> None:
        """Refuse a budget below the shortest reply the grammar accepts (engine/closing.py): the
        reply could not end valid within it."""
        if prompt.grammar is None:
            return
        from openalice_runner.engine.closing import shortest_reply

        context = self._context_length()
        room = sampling.max_tokens if context is None else min(sampling.max_tokens, context - len(prompt.ids))
        need = shortest_reply(prompt.grammar, room)
        if need is not None and need > room:
            where = "max_tokens" if room == sampling.max_tokens else "the context left after the prompt"
            raise ProviderBadRequest(
                f"max_tokens is {sampling.max_tokens}, below the minimum the schema needs: its shortest "
                f"valid reply takes {need} tokens here ({where} allows {room})",
                provider=self.name, param="max_tokens", code="invalid_value",
            )  # fmt: skip

    # ---- prompt ----

    def _renders_tools(self) -> bool:
        if self._template_tools is None:
            template = getattr(self.engine.tokenizer, "chat_template", None)
            self._template_tools = tool_format.template_renders_tools(
                template if isinstance(template, str) else None
            )
        return self._template_tools

    def build_prompt(self, request: ChatRequest) -> _Prompt:
        engine = self.engine
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
        if self._renders_tools():
            shown = tool_format.with_turn_rule(messages, choice) if tools else messages
            ids = engine.render_chat(tool_format.template_messages(shown), tools)
        elif tools or history_has_tools:
            ids = engine.render_chat(tool_format.render_fallback_messages(messages, tools, choice))
        else:
            ids = engine.render_chat(messages)
        grammar = self._grammar(request, callable_tools, choice)
        # A forced call's opening is pre-filled (the grammar would force it anyway; a weak model
        # also gets the first argument's key), and the grammar starts after it.
        prefill = tool_format.assistant_prefill(choice, callable_tools) if tools else ""
        if prefill and grammar is not None:
            prefill, grammar = self._prefill_within(grammar, prefill, choice)
        if prefill:
            ids = list(ids) + engine.encode(prefill)
        names = {t["function"]["name"] for t in callable_tools} if tools and choice != "none" else None
        return _Prompt(ids=list(ids), prefill=prefill, tool_names=names, grammar=grammar)

    def _prefill_within(self, grammar: Any, prefill: str, choice: Any) -> tuple[str, Any]:
        """The prefill and the grammar after it; where the grammar does not allow the argument
        opening (it writes the schema's properties in their order), the call's opening alone."""
        from openalice_runner.engine.grammar import GrammarError

        for text in (prefill, tool_format.assistant_prefill(choice)):
            try:
                return text, grammar.after(self.engine.encode(text))
            except GrammarError:
                continue
        return "", grammar

    def _grammar(self, request: ChatRequest, tools: list[dict[str, Any]] | None, choice: Any):
        """The grammar for tool_choice and response_format (None: the reply is free text).

        Tool calls take the fallback format (<tool_call> blocks, also what tool-rendering Hermes
        templates use): "required" one or more calls (one without parallel_tool_calls), a named
        function that call, "auto" a reply without calls or text followed by calls; the reply
        without calls is JSON where response_format asks for it; "none" a reply without calls.
        `tools`: the callable ones (allowed_tools' subset)."""
        from openalice_runner.engine.grammar import GrammarError, json_grammar, tool_call_grammar

        fmt = request.response_format
        content_json = fmt is not None and fmt.type != "text"
        schema = fmt.json_schema.schema_ if fmt is not None and fmt.json_schema is not None else None
        parallel = request.parallel_tool_calls is not False
        fmt_param = "response_format.json_schema.schema" if schema is not None else "response_format"
        if tools and choice == "none":
            text = json_grammar(schema) if content_json else tool_call_grammar(tools, "none")
            param = fmt_param if content_json else "tools"
        elif tools:
            if isinstance(choice, NamedToolChoice):
                chosen = [t for t in tools if t["function"]["name"] == choice.function.name]
                text = tool_call_grammar(chosen, "required", parallel=False)
            else:
                text = tool_call_grammar(tools, choice, parallel, content_schema=schema, content_json=content_json)
            param = "tools"
        elif content_json:
            text, param = json_grammar(schema), fmt_param
        else:
            return None
        try:
            return self.engine.grammars.compile(text)
        except GrammarError as exc:
            if param == "tools" and getattr(exc, "code", None) != "grammar_timeout":  # each tool could time out too
                param = self._refused_tool(tools or [], request) or param
            raise ProviderBadRequest(f"{param}: the grammar backend refused the schema: {exc}", provider=self.name,
                                     param=param, code=getattr(exc, "code", None) or "invalid_value") from exc

    def _refused_tool(self, tools: list[dict[str, Any]], request: ChatRequest) -> str | None:
        """The field whose schema the grammar backend refuses (each compiled alone)."""
        from openalice_runner.engine.grammar import GrammarError, json_grammar

        for i, tool in enumerate(tools):
            try:
                self.engine.grammars.compile(json_grammar(tool["function"].get("parameters")))
            except GrammarError:
                names = [t.function.name for t in request.tools or ()]
                index = names.index(tool["function"]["name"]) if tool["function"]["name"] in names else i
                return f"tools[{index}].function.parameters"
        if request.response_format is not None and request.response_format.json_schema is not None:
            return "response_format.json_schema.schema"
        return None

    def _settings(self, request: ChatRequest, ctx: CallContext, prompt: _Prompt):
        sampling = sampling_params(request.sampling, self.config.max_tokens_default)
        if prompt.prefill and tool_format.TOOL_CALL_CLOSE not in sampling.stop:
            # A forced call is one call: stop at its closing tag instead of rambling on.
            sampling = _replace_stop(sampling, (*sampling.stop, tool_format.TOOL_CALL_CLOSE))
        decision = ctx.decision
        spec = SpecConfig()
        if decision is not None:  # every SpecMethod is one the engine runs (ENGINE_SPEC_METHODS)
            spec = self._planned_spec(decision)
            if spec.method == "eagle":
                spec = self._usable_head(spec, decision)
        return sampling, spec

    def _planned_spec(self, decision: SpeculationPlan) -> SpecConfig:
        """The engine's settings for the policy's plan. Options the engine refuses (`policy check`
        refuses them first) are the operator's to fix, not the request's: no speculation, with a
        warning once per rule, rather than a 400 for a request that did nothing wrong."""
        try:
            spec = SpecConfig.from_plan(decision)
            if spec.method == "draft" and spec.draft_model:
                raise InvalidRequest("options.draft_model: the embedded engine drafts from the target's own "
                                     "layers only (options.draft_layers)", param="draft_model")
            return spec
        except (TypeError, ValueError) as exc:
            if decision.rule not in self._refused_rules:
                self._refused_rules.add(decision.rule)
                logger.warning("%s: rule %r: the engine cannot run its plan (%s); running without speculation",
                               self.name, decision.rule, exc)
            return SpecConfig()

    def _usable_head(self, spec: SpecConfig, decision: SpeculationPlan) -> SpecConfig:
        """`spec` where its EAGLE head loads; otherwise no speculation, with a warning: a policy
        naming a missing head is the operator's to fix, and must not fail every request."""
        try:
            self.engine.eagle_runtime(spec.eagle_head)
        except (ValueError, OSError) as exc:
            if spec.eagle_head not in self._unusable_heads:  # once per head, not once per request
                self._unusable_heads.add(spec.eagle_head)
                logger.warning("%s: rule %r: eagle head not usable (%s); running without speculation",
                               self.name, decision.rule, exc)
            return SpecConfig()
        return spec

    # ---- chat ----

    def _generate(self, request: ChatRequest, ctx: CallContext, cancel: threading.Event):
        result = None
        prompt = None
        for item in self._stream_worker(request, ctx, cancel):
            if prompt is None:
                prompt = item
            elif item.result is not None:
                result = item.result
        return prompt, result

    def _stream_worker(self, request: ChatRequest, ctx: CallContext, cancel: threading.Event):
        prompt = self.build_prompt(request)
        history = self._histories.get(ctx.conversation_id) if self.config.prefix_reuse else None
        if history:
            # the history re-rendered may split into other tokens than the engine holds (histories.py)
            prompt.ids = align_prompt(self.engine.tokenizer, history, prompt.ids)
        sampling, spec = self._settings(request, ctx, prompt)
        self._check_prompt(prompt, sampling)
        self._check_budget(prompt, sampling)
        yield prompt
        held = 0
        try:
            for event in self.engine.stream(prompt.ids, sampling, spec, cancel, grammar=prompt.grammar):
                grown = len(event.token_ids) + (len(prompt.ids) if held == 0 else 0)
                held += grown
                self._add_kv(grown)
                if event.result is not None and self.config.prefix_reuse:
                    self._histories.put(ctx.conversation_id, prompt.ids + event.result.token_ids)
                yield event
        finally:
            self._add_kv(-held)  # the engine's generator has closed: its positions are free

    def _add_kv(self, n: int) -> None:
        with self._kv_lock:
            self._kv_tokens += n

    async def chat(self, request: ChatRequest, ctx: CallContext) -> ChatResult:
        self.precheck(request)
        self._in_flight += 1
        cancel = threading.Event()
        try:
            try:
                # One hop to the worker thread for prompt and generation: each hop costs ~0.1 ms.
                prompt, result = await asyncio.to_thread(self._generate, request, ctx, cancel)
            except ProviderError:
                raise
            except Exception as exc:
                raise _engine_error(exc, self.name, started=False) from exc
        except asyncio.CancelledError:
            cancel.set()  # the worker thread stops at its next round
            raise
        finally:
            self._in_flight -= 1
        done = _Finished.of(result, prompt, ctx)
        content, tool_calls = _split(prompt, result.text, cut=_budget_ended(result))
        out = ChatResult.single(
            model=self.engine.model_name,
            content=content,
            tool_calls=tool_calls,
            finish_reason=_finish(result, bool(tool_calls)),
            usage=done.usage,
            speculation=done.speculation,
            provider=self.name,
        )
        return out.attach_outcome(done.outcome)

    # ---- stream ----

    def stream(self, request: ChatRequest, ctx: CallContext) -> AbstractAsyncContextManager[ChatStream]:
        return chat_stream(self._stream(request, ctx))

    async def _stream(self, request: ChatRequest, ctx: CallContext) -> AsyncGenerator[ChatChunk, None]:
        self.precheck(request)
        self._in_flight += 1
        try:
            events = _threaded(self._stream_worker, request, ctx)
            started = False
            result = None
            try:
                prompt = await anext(events)  # the worker renders the prompt first, then streams
                chunk_id, model = new_id("chatcmpl"), self.engine.model_name
                # calls stream as they are written where the grammar guarantees their form
                calls = ToolCallStream(prompt.prefill, prompt.tool_names, incremental=prompt.grammar is not None)
                async for event in events:
                    if event.result is not None:
                        result = event.result
                    for piece in calls.feed(event.text) if event.text else ():
                        yield ChatChunk.piece(chunk_id, model, piece.content, piece.tool_calls, first=not started)
                        started = True
            except ProviderError:
                raise
            except Exception as exc:
                raise _engine_error(exc, self.name, started=started) from exc
            finally:
                await events.aclose()
        finally:
            self._in_flight -= 1
        assert result is not None, "engine stream ended without a result"
        done = _Finished.of(result, prompt, ctx)
        end = calls.finish(budget_ended=_budget_ended(result))
        for piece in end.pieces:
            yield ChatChunk.piece(chunk_id, model, piece.content, piece.tool_calls, first=not started)
            started = True
        finish = _finish(result, bool(end.calls) and not end.cut)
        final = ChatChunk(
            id=chunk_id,
            model=model,
            choices=[ChunkChoice(finish_reason=finish)],
            usage=done.usage,
            speculation=done.speculation,
            provider=self.name,
        )
        yield final.attach_outcome(done.outcome)


# ---------------------------------------------------------------- helpers


@dataclass(frozen=True)
class _Finished:
    """What a plain reply and a stream's last chunk both report of a finished generation."""

    outcome: Any
    usage: Usage
    speculation: SpeculationInfo

    @classmethod
    def of(cls, result: Any, prompt: _Prompt, ctx: CallContext) -> _Finished:
        stats = result.stats
        _stamp(stats, ctx)
        outcome = stats.outcome()
        usage = Usage.of(stats.prompt_tokens or len(prompt.ids), stats.completion_tokens, stats.cached_prompt_tokens)
        return cls(outcome=outcome, usage=usage, speculation=_speculation(outcome, stats))


def _engine_error(exc: Exception, provider: str, *, started: bool) -> ProviderError:
    """The one mapping of an engine exception, for plain and streamed calls alike: overload is 429,
    the engine's checks of the request are the client's (400), anything else is ours (500); once a
    stream has sent chunks, both of the latter break it instead."""
    if isinstance(exc, EngineOverloaded):
        return ProviderRateLimited(str(exc), provider=provider)
    if isinstance(exc, InvalidRequest):
        return StreamBroken(str(exc), provider=provider) if started else _bad_request(exc, provider)
    if started:
        logger.error("%s: engine failed mid-stream", provider, exc_info=exc)
        return StreamBroken(f"engine failed mid-stream ({type(exc).__name__})", provider=provider)
    return _internal(exc, provider)


def _bad_request(exc: InvalidRequest, provider: str) -> ProviderBadRequest:
    return ProviderBadRequest(str(exc), provider=provider, param=exc.param, code=exc.code)


def _internal(exc: BaseException, provider: str) -> ProviderInternalError:
    """An engine fault: logged here with its traceback (the reply says only that it happened)."""
    logger.error("%s: engine fault", provider, exc_info=exc)
    return ProviderInternalError(f"engine fault ({type(exc).__name__}): {exc}", provider=provider, status_code=500)


def _split(prompt: _Prompt, text: str, *, cut: bool) -> tuple[str | None, list[ToolCall] | None]:
    if prompt.tool_names is None:
        return text, None
    parsed = tool_format.parse_tool_calls(prompt.prefill + text, prompt.tool_names)
    if parsed.malformed and cut and prompt.grammar is not None:
        # under a grammar a call block is well formed; one that is not was cut where closing did
        # not fit (finish_reason "length"): dropped, never raw markup as content
        logger.info("reply cut inside %d tool call(s); dropped", len(parsed.malformed))
        return tool_format.without_blocks(parsed), parsed.tool_calls or None
    if parsed.malformed:
        logger.info("model wrote %d malformed tool call(s); returned as content", len(parsed.malformed))
    return parsed.content, parsed.tool_calls or None


def _speculation(outcome: Any, stats: Any) -> SpeculationInfo:
    info = SpeculationInfo.from_outcome(outcome)
    info.closing = getattr(stats, "closing", 0) or None
    return info


def _finish(result: Any, calls: bool) -> Literal["stop", "length", "tool_calls"]:
    """A reply the budget ended (its structure closed to fit, or cut) says "length", its calls
    returned all the same; else "tool_calls" where it called, else the engine's reason."""
    if _budget_ended(result):
        return "length"
    return "tool_calls" if calls else _finish_reason(result.finish_reason)


def _budget_ended(result: Any) -> bool:
    return result.finish_reason in ("length", "context_length") or bool(getattr(result.stats, "closing", 0))


def _finish_reason(engine_finish: str) -> Literal["stop", "length"]:
    return "length" if engine_finish in ("length", "context_length") else "stop"


def _stamp(stats: Any, ctx: CallContext) -> None:
    decision = ctx.decision
    if decision is not None:
        stats.rule = decision.rule
        stats.policy_version = decision.policy_version


def sampling_params(settings: SamplingSettings, default_max_tokens: int = 256) -> SamplingParams:
    """The engine's `SamplingParams` for a request's OpenAI-style settings."""
    return SamplingParams(
        temperature=0.0 if settings.temperature is None else settings.temperature,
        top_p=1.0 if settings.top_p is None else settings.top_p,
        top_k=settings.top_k or 0,
        seed=settings.seed,
        max_tokens=settings.max_tokens or default_max_tokens,
        stop=tuple(settings.stop or ()),
    )


def _replace_stop(sampling: SamplingParams, stop: tuple[str, ...]) -> SamplingParams:
    from dataclasses import replace

    return replace(sampling, stop=stop)


_END = object()


class _threaded:
    """Iterate a blocking iterator in a worker thread as an async iterator; aclose() cancels it."""

    def __init__(self, fn, *args) -> None:
        self._cancel = threading.Event()
        self._fn, self._args = fn, args
        self._queue: asyncio.Queue | None = None
        self._future: asyncio.Future | None = None

    def __aiter__(self):
        return self

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._queue = queue
        cancel = self._cancel

        def put(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone: nobody is listening any more
                cancel.set()

        def work() -> None:
            iterator: Iterator[Any] = self._fn(*self._args, cancel=cancel)
            try:
                for item in iterator:
                    put(item)
                    if cancel.is_set():
                        break
            except BaseException as exc:  # handed to the consumer
                put(exc)
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()  # releases the engine's lock at once
                put(_END)

        self._future = loop.run_in_executor(None, work)

    async def __anext__(self) -> Any:
        if self._queue is None:
            self._start()
        assert self._queue is not None
        item = await self._queue.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        self._cancel.set()
