"""The Runner: the agentic loop's model backend.

    runner = Runner.from_config()                       # embedded default model
    async with runner.turn(conversation_id="c1", turn_type="tool_call", agent="alice") as turn:
        result = await turn.chat(messages, tools=tools)
        async with turn.tool("get_weather", call_id=result.tool_calls[0].id):
            ...                                         # the loop runs its tool here
        async for chunk in turn.stream(messages): ...
    await runner.aclose()

Per call: the route (turn type, model) names a fallback chain; each provider in it is wrapped as
AdmittedProvider(PolicyProvider(InstrumentedProvider(provider))): the provider's admission gate
holds a slot for the call or refuses it at once when its queue is full, the policy decides
speculation for the provider that will serve, with its current load as batch size, tracing records
the call, and the fallback moves on only before the first token. The sidecar calls `runner.chat` /
`runner.stream` directly. Sync code uses `SyncRunner` (`runner.sync()`, sync_runner.py), which drives
the same Runner on a private loop thread. Beside it: a turn's calls and tool steps (turn.py), the
policy argument resolved (policies/setting.py) and providers built by `type` (providers/registry.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from openalice_runner.policies.setting import (
    DEFAULT_POLICY,
    NO_POLICY,
    PolicyArg,
    PolicySetting,
    policy_file,
    policy_setting,
    policy_store,
)
from openalice_runner.providers.base import CallContext, Provider
from openalice_runner.providers.config import (
    CATCH_ALL_MODEL,
    ProviderConfig,
    Route,
    RoutingConfig,
    load_routing_file,
)
from openalice_runner.providers.registry import EngineArg, build_provider
from openalice_runner.providers.streams import ChatStream, chat_stream
from openalice_runner.providers.wrappers.admission import (
    AdmissionGate,
    AdmissionLimits,
    AdmissionRefused,
    AdmittedProvider,
)
from openalice_runner.providers.wrappers.fallback import FallbackProvider
from openalice_runner.providers.wrappers.policy import PolicyProvider
from openalice_runner.speculation import SpeculationPolicy
from openalice_runner.sync_runner import SyncRunner, SyncTurn
from openalice_runner.turn import MessagesArg, ToolStep, Turn
from openalice_runner.types import ChatChunk, ChatRequest, ChatResult

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider

    from openalice_runner.prompt_log import PromptLog
    from openalice_runner.tracing import RunnerTelemetry

# the library's names, importable from here as they always were (each is defined where its job is)
__all__ = [
    "DEFAULT_POLICY", "NO_POLICY", "EngineArg", "MessagesArg", "PolicyArg", "PolicySetting", "Runner",
    "SpeculationPolicy", "SyncRunner", "SyncTurn", "ToolStep", "Turn", "build_provider", "policy_setting",
]  # fmt: skip

logger = logging.getLogger(__name__)


class Runner:
    def __init__(
        self,
        routing: RoutingConfig,
        providers: dict[str, Provider],
        policy: SpeculationPolicy | None = None,
        telemetry: RunnerTelemetry | None = None,
        admission: AdmissionLimits | None = None,
    ) -> None:
        self.routing = routing
        self.providers = providers  # name -> the bare provider
        self.policy = policy  # None: no policy (from_config resolves the default policy to a store)
        self.telemetry = telemetry
        # One gate per provider, shared by every route naming it. `admission`: defaults for the limits
        # a provider's own config leaves unset (the server's flags).
        self._admission = admission
        self._built_from = dict(routing.providers)  # name -> the config each provider was built from
        self.gates = {
            name: AdmissionGate.for_provider(
                name, provider.kind, _limits_of(routing.providers.get(name)).over(admission)
            )
            for name, provider in providers.items()
        }
        self._chains = {route.name: self._chain(route.chain) for route in routing.routes}
        self._owns_policy_watch = False
        self.prompt_log: PromptLog | None = None  # saved traffic for `draft train`

    # ---- construction ----

    @classmethod
    def from_config(
        cls,
        providers: str | Path | RoutingConfig | None = None,
        policy: PolicyArg = DEFAULT_POLICY,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        *,
        telemetry: RunnerTelemetry | Literal[False] | None = None,
        watch_policy: bool = False,
        engine: EngineArg = None,
        record_content: bool = False,
        admission: AdmissionLimits | None = None,
        prompt_log: str | Path | None = None,
    ) -> Runner:
        """Build from a routing file (None: embedded default) and a policy.

        policy: a policy file, a PolicyStore, `DEFAULT_POLICY` (the default: the policy shipped in the
        package, openalice_runner/defaults/policy.yaml, a copy of policies/default.yaml) or `NO_POLICY`
        (no policy, speculation off). The older spellings still work: None means DEFAULT_POLICY and
        False means NO_POLICY. telemetry False: no tracing; None: a
        RunnerTelemetry on the given (or the global OpenTelemetry) providers. engine: an Engine
        for every `local` provider (tests and benchmarks pass a tiny one). prompt_log: a JSON-lines
        file that keeps every request's prompt, for `draft train --data` (off by default).
        """
        if providers is None:
            routing = RoutingConfig.default()
        elif isinstance(providers, RoutingConfig):
            routing = providers
        else:
            routing = load_routing_file(providers)
            _check_pools(policy_setting(policy), providers)
        store = policy_store(policy_setting(policy), watch_policy)
        if telemetry is None:
            from openalice_runner.tracing import RunnerTelemetry

            telemetry = RunnerTelemetry(tracer_provider, meter_provider, record_content=record_content)
        elif telemetry is False:
            telemetry = None
        built = {name: build_provider(name, cfg, engine) for name, cfg in routing.providers.items()}
        runner = cls(routing, built, policy=store, telemetry=telemetry, admission=admission)
        runner._owns_policy_watch = watch_policy and store is not None
        if prompt_log is not None:
            from openalice_runner.prompt_log import PromptLog

            runner.prompt_log = PromptLog(prompt_log)
        return runner

    def _chain(self, names: list[str]) -> FallbackProvider:
        wrapped: list[Provider] = []
        for name in names:
            provider = self.providers[name]
            if self.telemetry is not None:
                from openalice_runner.providers.wrappers.instrumented import InstrumentedProvider

                provider = InstrumentedProvider(provider, self.telemetry)
            if self.policy is not None:
                provider = PolicyProvider(provider, self.policy, name)
            wrapped.append(AdmittedProvider(provider, self.gates[name]))
        return FallbackProvider(wrapped)

    # ---- what the sidecar calls ----

    def model_names(self) -> list[str]:
        names: list[str] = []
        for route in self.routing.routes:
            names += [n for n in route.match.models or [] if n != CATCH_ALL_MODEL]
        for provider in self.providers.values():
            names += provider.model_names
        return list(dict.fromkeys(names))

    def route_for(self, turn_type: str, model: str | None) -> Route:
        """The route of a request; UnknownModelError when no route takes its model name."""
        served_by = {name: provider.model_names for name, provider in self.providers.items()}
        return self.routing.route_for(turn_type, model, served_by)

    def chain_for(self, turn_type: str, model: str | None) -> FallbackProvider:
        return self._chains[self.route_for(turn_type, model).name]

    def apply_routing(self, routing: RoutingConfig) -> list[str]:
        """Apply an edited routing config live, as far as that is safe with requests running: routes
        and admission limits change at once, new providers are added. A provider whose definition
        changed (type, model, URLs, keys) is not swapped under its running requests: it keeps its old
        definition, and its name is returned as needing a restart."""
        needs_restart, added, resized = [], {}, {}
        for name, config in routing.providers.items():  # first build, so a failure changes nothing
            limits = _limits_of(config).over(self._admission)
            if name not in self.providers:
                provider = build_provider(name, config)
                added[name] = (provider, AdmissionGate.for_provider(name, provider.kind, limits))
            elif name in self._built_from and _definition(self._built_from[name]) != _definition(config):
                needs_restart.append(name)
                routing.providers[name] = self._built_from[name]
            else:
                resized[name] = AdmissionGate.for_provider(name, self.providers[name].kind, limits)
        for name, (provider, gate) in added.items():
            self.providers[name], self.gates[name] = provider, gate
            self._built_from[name] = routing.providers[name]
        for name, fresh in resized.items():
            self.gates[name].resize(fresh.max_in_flight, fresh.max_queue)
        self.routing = routing
        self._chains = {route.name: self._chain(route.chain) for route in routing.routes}
        return needs_restart

    def refusal(self, turn_type: str, model: str | None) -> AdmissionRefused | None:
        """The refusal a request would get now if every provider of its chain is full, else None:
        lets the sidecar answer 429 before it opens spans or reads the body further. The gates
        still decide for real when the request runs."""
        route = self.route_for(turn_type, model)
        gates = [self.gates[name] for name in route.chain]
        if not all(gate.full() for gate in gates):
            return None
        for gate in gates:
            gate.refused += 1
        return min((gate.refusal() for gate in gates), key=lambda r: r.retry_after or 0)

    async def chat(self, request: ChatRequest, ctx: CallContext | None = None) -> ChatResult:
        ctx = ctx or CallContext()
        result = await self.chain_for(ctx.turn_type, request.model).chat(request, ctx)
        if self.prompt_log is not None:  # kept once answered: a refused or failed request is no traffic
            self.prompt_log.record(request, ctx.turn_type)
        return result

    def stream(
        self, request: ChatRequest, ctx: CallContext | None = None
    ) -> AbstractAsyncContextManager[ChatStream]:
        """`async with runner.stream(request) as chunks: async for chunk in chunks: ...`; leaving the
        block stops the generation and frees the provider's slot."""
        ctx = ctx or CallContext()
        opened = self.chain_for(ctx.turn_type, request.model).stream(request, ctx)
        if self.prompt_log is None:
            return opened
        return _logged(opened, self.prompt_log, request, ctx)

    # ---- what the loop calls ----


    def turn(
        self, conversation_id: str | None = None, turn_type: str = "chat", agent: str | None = None
    ) -> Turn:
        return Turn(self, conversation_id, turn_type, agent)

    def sync(self) -> SyncRunner:
        return SyncRunner(self)

    async def aclose(self) -> None:
        if self._owns_policy_watch:
            getattr(self.policy, "stop_watching")()  # noqa: B009 (a PolicyStore's; the protocol lacks it)
        for provider in self.providers.values():
            try:
                await provider.aclose()
            except Exception:
                logger.exception("closing provider %s failed", provider.name)

    async def __aenter__(self) -> Runner:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _definition(config: ProviderConfig) -> dict[str, Any]:
    """A provider's config without its admission limits (those change live)."""
    return config.model_dump(exclude={"max_in_flight", "max_queue"})


def _limits_of(config: ProviderConfig | None) -> AdmissionLimits:
    return AdmissionLimits(
        max_in_flight=getattr(config, "max_in_flight", None), max_queue=getattr(config, "max_queue", None)
    )


def _check_pools(policy: str | Path | SpeculationPolicy | PolicySetting, providers: str | Path) -> None:
    """At load, the policy file's rules against the SGLang pools the routing file deploys
    (ConfigError naming each problem); a policy given as an object or switched off has no file."""
    path = policy_file(policy)
    if path is None:
        return
    from openalice_runner.config_files import ConfigError
    from openalice_runner.pool_checks import check_pool_files

    problems = check_pool_files(path, providers)
    if problems:
        raise ConfigError(problems)


@contextlib.asynccontextmanager
async def _logged(
    opened: AbstractAsyncContextManager[ChatStream], log: PromptLog, request: ChatRequest, ctx: CallContext
) -> AsyncIterator[ChatStream]:
    """The stream, with its prompt kept once it was read to its end (a stream left early, cut
    or failed is not kept: it produced no completion)."""
    ended = False

    async def through(chunks: ChatStream) -> AsyncGenerator[ChatChunk, None]:
        nonlocal ended
        async for chunk in chunks:
            yield chunk
        ended = True

    async with opened as chunks, chat_stream(through(chunks)) as logged:
        yield logged
    if ended:
        log.record(request, ctx.turn_type)
