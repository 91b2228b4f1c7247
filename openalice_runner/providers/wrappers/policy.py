"""PolicyProvider: asks the speculation policy before each call and feeds it the outcome after.

It wraps one provider of a fallback chain, so each attempt is decided for the provider that will
actually serve it, with that provider's own load as the batch size (the request itself included).
The plan travels in a copy of the CallContext (tracing reads it there); the finished request's
outcome goes to `policy.observe` for adaptive γ. The plan carries γ by batch size
(`per_batch`), which a batching engine follows step by step.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

from openalice_runner.providers.base import CallContext, Provider, ProviderLoad
from openalice_runner.providers.streams import ChatStream, chat_stream
from openalice_runner.providers.wrappers.wrapper import WrapperProvider
from openalice_runner.speculation import SpeculationOutcome, SpeculationPlan, SpeculationPolicy
from openalice_runner.types import ChatChunk, ChatRequest, ChatResult


def _batch(load: ProviderLoad) -> int | None:
    """The batch a request joining now makes: running + 1, capped by the provider's batch limit;
    None (unknown) where the provider reads load and could read none."""
    if load.unknown:
        return None
    batch = (load.batch_size or 0) + 1
    if load.max_batch is not None:  # SGLang max_running_requests, vLLM max_num_seqs
        batch = min(batch, load.max_batch)
    return batch


class PolicyProvider(WrapperProvider):
    def __init__(self, wrapped: Provider, policy: SpeculationPolicy, provider_name: str | None = None) -> None:
        super().__init__(wrapped)
        self.policy = policy  # a PolicyStore, or the caller's own
        self.provider_name = provider_name or wrapped.name

    async def decide(self, request: ChatRequest, ctx: CallContext) -> CallContext:
        if ctx.plan is not None:
            return ctx  # decided upstream (e.g. pinned by the caller)
        from openalice_runner.policies import RequestContext

        load = await self.wrapped.current_load()

        def decide(load: ProviderLoad) -> SpeculationPlan:
            return self.policy.decide(
                RequestContext(
                    turn_type=ctx.turn_type,
                    batch_size=_batch(load),
                    provider=self.provider_name,
                    model=request.model or ctx.model,
                    tenant=ctx.tenant,
                )
            )

        plan = decide(load)
        # A pool provider's rules name a pool, and the batch a request joins is that pool's: decide
        # again on its load where it differs from the provider-wide figure (once: the pool the second
        # plan names is where the request goes)
        pool_load = self.wrapped.pool_load(plan.pool) if plan.pool else None
        if pool_load is not None and _batch(pool_load) != _batch(load):
            plan = decide(pool_load)
        return replace(ctx, plan=plan)

    def observe(self, ctx: CallContext, outcome: SpeculationOutcome | None) -> None:
        if outcome is not None:
            # per tenant where there is one (a policy of the caller's own may not take `tenant`)
            whose = {} if ctx.tenant is None else {"tenant": ctx.tenant}
            self.policy.observe(ctx.turn_type, outcome.method, self.provider_name, outcome, **whose)

    async def chat(self, request: ChatRequest, ctx: CallContext) -> ChatResult:
        ctx = await self.decide(request, ctx)
        result = await self.wrapped.chat(request, ctx)
        self.observe(ctx, result.outcome)
        return result

    @asynccontextmanager
    async def stream(self, request: ChatRequest, ctx: CallContext) -> AsyncIterator[ChatStream]:
        ctx = await self.decide(request, ctx)
        async with self.wrapped.stream(request, ctx) as chunks, chat_stream(self._observed(chunks, ctx)) as out:
            yield out

    async def _observed(self, chunks: ChatStream, ctx: CallContext) -> AsyncGenerator[ChatChunk, None]:
        async for chunk in chunks:
            if chunk.finish_reason is not None:
                self.observe(ctx, chunk.outcome)
            yield chunk
