"""What the sidecar needs of a Runner, as a type: the app calls these and nothing else.

openalice_runner.runner.Runner is the one implementation; a test may hand in another that has all of it.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from openalice_runner.policies import PolicyStore
from openalice_runner.providers.base import CallContext, Provider
from openalice_runner.providers.streams import ChatStream
from openalice_runner.providers.wrappers.admission import AdmissionGate, AdmissionRefused
from openalice_runner.types import ChatRequest, ChatResult

if TYPE_CHECKING:  # annotations only: the routing config imports every provider type
    from openalice_runner.providers.config import RoutingConfig
    from openalice_runner.speculation import SpeculationPolicy


@runtime_checkable
class ServedRunner(Protocol):
    policy: SpeculationPolicy | None  # a PolicyStore's is shown (/v1/policy, /health) and watched
    routing: RoutingConfig  # the routing in force (its turn types are metric labels)
    providers: dict[str, Provider]  # name -> the bare provider (loaded at startup, memory metrics)
    gates: dict[str, AdmissionGate]  # name -> its admission gate (metrics)

    async def chat(self, request: ChatRequest, ctx: CallContext | None = None) -> ChatResult: ...

    def stream(
        self, request: ChatRequest, ctx: CallContext | None = None
    ) -> AbstractAsyncContextManager[ChatStream]: ...

    def model_names(self) -> list[str]: ...

    def refusal(self, turn_type: str, model: str | None) -> AdmissionRefused | None:
        """The 429 a request would get now; raises LookupError when no route matches."""
        ...

    def apply_routing(self, routing: RoutingConfig) -> list[str]:
        """Apply an edited routing file live; the names of providers that need a restart."""
        ...

    async def aclose(self) -> None: ...


def policy_store(runner: ServedRunner) -> PolicyStore | None:
    """The runner's policy when it is a PolicyStore: one with a version, a file, a reload error to show
    and to watch. None without a policy or for a policy of another kind (decide and observe only)."""
    policy = runner.policy
    return policy if isinstance(policy, PolicyStore) else None
