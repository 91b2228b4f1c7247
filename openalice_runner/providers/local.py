"""The embedded provider (`type: local` in a routing file): the engine (torch, CPU) in-process, with
tool calling through the prompt.

The engine's calls block, so each request runs in a worker thread and the event loop stays free;
with `max_batch` > 1 the engine decodes the requests in flight together (continuous batching), and
its scheduler's running and waiting counts are this provider's load. How many may run and queue is
the admission gate's business (providers/wrappers/admission.py), in front of this provider. Requests
the model can never serve (a prompt longer than its context, max_tokens past it) are refused before
they reach the engine. The policy's SpeculationPlan becomes the request's SpecConfig; a method the
engine cannot run is downgraded to "off" and the result says so.

This is the one module of the wing that touches the engine (the rest of providers/embedded/ is
torch-free): settings in config.py, the prompt and its bounds in prompt.py, the reply's grammar in
grammar.py (compiled through `_EngineGrammars`), tool prompts and parsing in tool_format.py, the reply
and the stream's chunks in results.py, and the one mapping of engine exceptions in errors.py.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from typing import Any

from openalice_runner.engine.errors import InvalidRequest
from openalice_runner.engine.histories import ConversationHistories, align_prompt
from openalice_runner.engine.types import EngineOverloaded, SamplingParams, SpecConfig
from openalice_runner.providers.base import CallContext, Capabilities, Provider, ProviderError, ProviderLoad
from openalice_runner.providers.embedded import prompt as prompts
from openalice_runner.providers.embedded import results, tool_format
from openalice_runner.providers.embedded.config import EmbeddedConfig
from openalice_runner.providers.embedded.errors import EngineErrors
from openalice_runner.providers.embedded.prompt import ContextBounds, Prompt
from openalice_runner.providers.streams import ChatStream, chat_stream
from openalice_runner.speculation import SPEC_METHODS, SpeculationPlan
from openalice_runner.types import ChatChunk, ChatRequest, ChatResult, SamplingSettings

logger = logging.getLogger(__name__)

ENGINE_SPEC_METHODS = frozenset(SPEC_METHODS)
ENGINE_ERRORS = EngineErrors(overloaded=EngineOverloaded, invalid=InvalidRequest)


class EmbeddedProvider(Provider):
    """The provider's face: the engine, loaded on first use, and its load; calls go to `_EngineCalls`."""

    kind = "local"
    gen_ai_provider_name = "openalice"

    def __init__(self, name: str, config: EmbeddedConfig, engine: Any = None) -> None:
        self.name = name
        self.config = config
        self.capabilities = Capabilities(tools=True, streaming=True, spec_methods=ENGINE_SPEC_METHODS)
        self._engine = engine
        self._engine_lock = threading.Lock()
        self._template_tools: bool | None = None
        # (tenant, conversation id) -> its last call's token ids: one tenant's id never reads another's
        self._histories = ConversationHistories()
        # the context is None while the engine is not loaded (nothing to check against yet)
        self._bounds = ContextBounds(name, lambda: getattr(self._engine, "context_length", None),
                                     lambda: self.engine.tokenizer, lambda: self.engine)
        self._runs = _EngineRuns(self, self._histories, self._bounds)
        self._calls = _EngineCalls(self, self._runs)
        self.warm_up_s: float | None = None  # how long the start-up's warm-up call took (None: not run)

    @property
    def engine(self) -> Any:
        """The engine, loaded on first use (a real model takes seconds to load)."""
        if self._engine is None:
            with self._engine_lock:
                if self._engine is None:
                    self._engine = _load_engine(self.config)
        return self._engine

    async def ensure_loaded(self) -> None:
        await asyncio.to_thread(lambda: self.engine)
        if self.config.warm_up if self.config.warm_up is not None else not self.config.tiny_random:
            await asyncio.to_thread(self.warm_up)

    def warm_up(self) -> float:
        """One short grammar-constrained call through the whole path, so that what the first request
        of a kind initialises (llguidance's matcher and lexer, the kernels' first passes) is paid at
        start-up, before `serve` takes traffic. Returns its seconds (also `warm_up_s`); runs once."""
        if self.warm_up_s is None:
            t0 = time.perf_counter()
            self._runs.generate(_warm_up_request(), CallContext(turn_type="tool_call"), threading.Event())
            self.warm_up_s = time.perf_counter() - t0
            logger.info("%s: warmed up in %.2f s (prefill: %s)", self.name, self.warm_up_s,
                        getattr(self.engine, "prefill", None))
        return self.warm_up_s

    @property
    def model_names(self) -> list[str]:
        return [self._engine.model_name] if self._engine is not None else [self.config.model or "SmolLM2-135M-Instruct"]

    def load(self) -> ProviderLoad:
        scheduler = getattr(self._engine, "scheduler", None)
        if scheduler is not None:  # the batching engine knows its batch and its waiting line
            running, waiting = scheduler.load
            return ProviderLoad(batch_size=running, queue_depth=waiting)
        in_flight = self._calls.in_flight
        return ProviderLoad(batch_size=in_flight, queue_depth=max(0, in_flight - 1))

    @property
    def kv_tokens_in_use(self) -> int:
        return self._runs.kv_tokens

    def precheck(self, request: ChatRequest) -> None:
        self._bounds.precheck(request)

    def build_prompt(self, request: ChatRequest) -> Prompt:
        engine = self.engine
        if self._template_tools is None:  # does the chat template render the tools itself (tool_format)
            template = getattr(engine.tokenizer, "chat_template", None)
            self._template_tools = tool_format.template_renders_tools(template if isinstance(template, str) else None)
        return prompts.build_prompt(request, engine, _EngineGrammars(self), renders_tools=self._template_tools,
                                    provider=self.name)

    async def chat(self, request: ChatRequest, ctx: CallContext) -> ChatResult:
        return await self._calls.chat(request, ctx)

    def stream(self, request: ChatRequest, ctx: CallContext) -> AbstractAsyncContextManager[ChatStream]:
        return chat_stream(self._calls.stream(request, ctx))


class _EngineCalls:
    """Plain and streamed calls on the event loop: checked first (the provider's precheck), one hop to
    a worker thread for prompt and generation (`_EngineRuns`), cancelled with the call, counted in
    flight (the provider's load), and every engine exception mapped by the one ENGINE_ERRORS."""

    def __init__(self, provider: EmbeddedProvider, runs: _EngineRuns) -> None:
        self._provider = provider
        self._runs = runs
        self.in_flight = 0

    async def chat(self, request: ChatRequest, ctx: CallContext) -> ChatResult:
        provider = self._provider
        provider.precheck(request)
        self.in_flight += 1
        cancel = threading.Event()
        try:
            # One hop to the worker thread for prompt and generation: each hop costs ~0.1 ms.
            prompt, result = await asyncio.to_thread(self._runs.generate, request, ctx, cancel)
        except asyncio.CancelledError:
            cancel.set()  # the worker thread stops at its next round
            raise
        except ProviderError:
            raise
        except Exception as exc:
            raise ENGINE_ERRORS.provider_error(exc, provider.name, started=False) from exc
        finally:
            self.in_flight -= 1
        return results.reply(result, prompt, ctx, model=provider.engine.model_name, provider=provider.name)

    async def stream(self, request: ChatRequest, ctx: CallContext) -> AsyncGenerator[ChatChunk, None]:
        provider = self._provider
        provider.precheck(request)
        self.in_flight += 1
        try:
            events, reply = _threaded(self._runs.events, request, ctx), None
            try:
                prompt = await anext(events)  # the worker renders the prompt first, then streams
                reply = results.StreamedReply(prompt, model=provider.engine.model_name, provider=provider.name)
                async for event in events:
                    for chunk in reply.feed(event):
                        yield chunk
            except ProviderError:
                raise
            except Exception as exc:
                raise ENGINE_ERRORS.provider_error(exc, provider.name, started=bool(reply and reply.started)) from exc
            finally:
                await events.aclose()
        finally:
            self.in_flight -= 1
        for chunk in reply.end(ctx):
            yield chunk


class _EngineRuns:
    """A request's run on the engine, in a worker thread: its prompt, settings and checks, then the
    engine's events. Counts the KV positions running generations hold (back to 0 when they end) and,
    with prefix reuse, keeps each conversation's last token ids."""

    def __init__(self, provider: EmbeddedProvider, histories: ConversationHistories, bounds: ContextBounds) -> None:
        self._provider = provider
        self._histories = histories
        self._bounds = bounds
        self._settings = _RequestSettings(provider)
        self.kv_tokens = 0  # KV positions held by running generations
        self._kv_lock = threading.Lock()  # worker threads update it

    def generate(self, request: ChatRequest, ctx: CallContext, cancel: threading.Event) -> tuple[Prompt, Any]:
        """The prompt and the engine's result."""
        result = None
        prompt = None
        for item in self.events(request, ctx, cancel):
            if prompt is None:
                prompt = item
            elif item.result is not None:
                result = item.result
        return prompt, result

    def events(self, request: ChatRequest, ctx: CallContext, cancel: threading.Event) -> Iterator[Any]:
        """The prompt first (refused here where the model cannot serve it), then the engine's events."""
        provider = self._provider
        reuse = provider.config.prefix_reuse
        prompt = provider.build_prompt(request)
        conversation = ctx.scoped_conversation  # the id scoped by its tenant
        history = self._histories.get(conversation) if reuse else None
        if history:
            # the history re-rendered may split into other tokens than the engine holds (histories.py)
            t0 = time.perf_counter()
            prompt.ids = align_prompt(provider.engine.tokenizer, history, prompt.ids)
            prompt.times["history_align"] = time.perf_counter() - t0
        sampling, spec = self._settings.of(request, ctx, prompt)
        self._bounds.check_prompt(prompt)
        self._bounds.check_budget(prompt, sampling.max_tokens, _shortest_reply)
        prompt.budget = self._bounds.budget(prompt, sampling.max_tokens)
        if prompt.budget != sampling.max_tokens:  # clamped to what the context leaves
            sampling = replace(sampling, max_tokens=prompt.budget)
        yield prompt
        held = 0
        # the tenant, where there is one: what the request leaves in the engine serves it alone
        # (engines stood in by tests take no tenant)
        whose = {} if ctx.tenant is None else {"tenant": ctx.tenant}
        try:
            for event in provider.engine.stream(prompt.ids, sampling, spec, cancel, grammar=prompt.grammar, **whose):
                grown = len(event.token_ids) + (len(prompt.ids) if held == 0 else 0)
                held += grown
                self._add_kv(grown)
                if event.result is not None and reuse:
                    self._histories.put(conversation, prompt.ids + event.result.token_ids)
                yield event
        finally:
            self._add_kv(-held)  # the engine's generator has closed: its positions are free

    def _add_kv(self, n: int) -> None:
        with self._kv_lock:
            self.kv_tokens += n


class _RequestSettings:
    """A request's sampling and speculation settings for the engine, from its own settings and the
    policy's plan. A plan the engine cannot run is the operator's to fix, not the request's: no
    speculation, with a warning once per rule (or head), rather than a 400 for a request that did
    nothing wrong."""

    def __init__(self, provider: EmbeddedProvider) -> None:
        self._provider = provider
        self._unusable_heads: set[str | None] = set()  # eagle heads already reported as not loading
        self._refused_rules: set[str | None] = set()  # policy rules already reported as not runnable

    def of(self, request: ChatRequest, ctx: CallContext, prompt: Prompt) -> tuple[SamplingParams, SpecConfig]:
        sampling = sampling_params(request.sampling, self._provider.config.max_tokens_default)
        if prompt.prefill and tool_format.TOOL_CALL_CLOSE not in sampling.stop:
            # A forced call is one call: stop at its closing tag instead of rambling on.
            sampling = replace(sampling, stop=(*sampling.stop, tool_format.TOOL_CALL_CLOSE))
        plan = ctx.plan
        spec = SpecConfig()
        if plan is not None:  # every SpecMethod is one the engine runs (ENGINE_SPEC_METHODS)
            spec = self._planned_spec(plan)
            if spec.method == "eagle":
                spec = self._usable_head(spec, plan)
        return sampling, spec

    def _planned_spec(self, plan: SpeculationPlan) -> SpecConfig:
        """The engine's settings for the policy's plan (options the engine refuses, which `policy
        check` refuses first: none)."""
        try:
            spec = SpecConfig.from_plan(plan)
            if spec.method == "draft" and spec.draft_model:
                raise InvalidRequest("options.draft_model: the embedded engine drafts from the target's own "
                                     "layers only (options.draft_layers)", param="draft_model")
            return spec
        except (TypeError, ValueError) as exc:
            if plan.rule not in self._refused_rules:
                self._refused_rules.add(plan.rule)
                logger.warning("%s: rule %r: the engine cannot run its plan (%s); running without speculation",
                               self._provider.name, plan.rule, exc)
            return SpecConfig()

    def _usable_head(self, spec: SpecConfig, plan: SpeculationPlan) -> SpecConfig:
        """`spec` where its EAGLE head loads; otherwise no speculation (a policy naming a missing
        head must not fail every request)."""
        try:
            self._provider.engine.eagle_runtime(spec.eagle_head)
        except (ValueError, OSError) as exc:
            if spec.eagle_head not in self._unusable_heads:  # once per head, not once per request
                self._unusable_heads.add(spec.eagle_head)
                logger.warning("%s: rule %r: eagle head not usable (%s); running without speculation",
                               self._provider.name, plan.rule, exc)
            return SpecConfig()
        return spec


class _EngineGrammars:
    """embedded/grammar.py's GrammarBackend: the engine's grammar text and compiler (engine/grammar.py
    imports torch: imported on first use, as the compiler's tables are built then)."""

    def __init__(self, provider: EmbeddedProvider) -> None:
        self._provider = provider

    @property
    def error(self) -> type[Exception]:
        from openalice_runner.engine.grammar import GrammarError

        return GrammarError

    def compile(self, text: str) -> Any:
        return self._provider.engine.grammars.compile(text)

    def json_grammar(self, schema: dict[str, Any] | None) -> str:
        from openalice_runner.engine.grammar import json_grammar

        return json_grammar(schema)

    def tool_call_grammar(self, tools: list[dict[str, Any]], mode: str, parallel: bool = True,
                          content_schema: dict[str, Any] | None = None, content_json: bool = False) -> str:
        from openalice_runner.engine.grammar import tool_call_grammar

        return tool_call_grammar(tools, mode, parallel, content_schema=content_schema, content_json=content_json)

    def encode(self, text: str) -> list[int]:
        return self._provider.engine.encode(text)


def _shortest_reply(grammar: Any, room: int) -> int | None:
    """engine/closing.py's: the fewest tokens a reply under `grammar` takes (imported on first use)."""
    from openalice_runner.engine.closing import shortest_reply

    return shortest_reply(grammar, room)


def _load_engine(cfg: EmbeddedConfig) -> Any:
    from openalice_runner.engine import Engine

    kv_bytes = None if cfg.kv_cache_mib is None else cfg.kv_cache_mib * 2**20
    if cfg.tiny_random:
        return Engine.tiny_random(max_batch=cfg.max_batch, prefix_reuse=cfg.prefix_reuse, kv_cache_bytes=kv_bytes)
    engine = Engine.load(
        cfg.model, dtype=cfg.dtype, threads=cfg.threads, max_batch=cfg.max_batch,
        prefix_reuse=cfg.prefix_reuse, kv_cache_bytes=kv_bytes, prefill=cfg.prefill,
    )  # fmt: skip
    engine.time_passes()  # drafts are sized from the first request on
    engine.grammars  # noqa: B018 - the tokenizer's grammar tables (~2 s), before the first request
    return engine


def _warm_up_request() -> ChatRequest:
    """warm_up's call: one tool offered (tool_choice "auto"), 8 tokens at temperature 0."""
    return ChatRequest.model_validate({
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "Current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }}],
        "max_tokens": 8, "temperature": 0,
    })  # fmt: skip


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
