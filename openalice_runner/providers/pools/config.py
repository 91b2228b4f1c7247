"""A pool provider's entry in a routing file: what every pool has and what every pool provider has
(the timeouts, load reading and affinity settings). A dialect (sglang/provider.py, vllm/provider.py)
narrows `pools` to its own pool class, which adds the launch settings and how γ follows from them."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from openalice_runner.config_files.models import StrictModel
from openalice_runner.providers.wrappers.admission import AdmissionLimits
from openalice_runner.speculation import SpecMethod, SpeculationPlan


class PoolBase(StrictModel):
    """What every pool has: its replicas' base URLs (e.g. http://10.0.0.5:30000). A dialect adds
    its `launch` settings and how γ follows from them."""

    replicas: list[str] = Field(min_length=1)
    # Where `replicas` is a gateway (smg) in front of the pool's workers: the workers, read for the
    # pool's load (the gateway's /metrics are its own), while requests go to the gateway.
    load_from: list[str] | None = Field(None, min_length=1)

    @field_validator("replicas", "load_from")
    @classmethod
    def _urls(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return None
        for url in v:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica {url!r} must be an http(s) URL")
        return [u.rstrip("/") for u in v]

    @property
    def method(self) -> SpecMethod:
        raise NotImplementedError

    @property
    def adaptive(self) -> bool:  # γ varies per round (SGLang adaptive, vLLM per-batch-size table)
        return False

    def gamma_for(self, plan: SpeculationPlan | None = None) -> int:
        raise NotImplementedError


def plan_gamma(plan: SpeculationPlan | None) -> int | None:
    """The deciding rule's largest γ (an auto rule's range even where auto chose off: the pool's
    servers draft regardless); None without a plan or with one that never speculates."""
    if plan is None:
        return None
    if plan.gamma_range:
        return plan.gamma_range[1]
    return plan.gamma or None


class PoolConfigBase(AdmissionLimits):  # max_in_flight / max_queue: the gate in front of it
    model: str  # the served model name the servers answer to
    pools: dict[str, Any]  # a dialect narrows it to its own pool class
    default_pool: str | None = None
    api_key_env: str | None = None  # env var holding the servers' --api-key, if set
    connect_timeout_s: float = Field(default=2.0, gt=0)
    first_token_timeout_s: float = Field(default=60.0, gt=0)  # also the gap allowed between chunks
    load_cache_s: float = Field(default=0.5, ge=0)
    # A reading older than load_cache_s but younger than this is used at once, and a fresh one is
    # read in the background once the call ends: a /metrics scrape (~15 ms of a busy CPU server's
    # time) is then neither waited for nor run beside the request it would slow. Older readings
    # are waited for. The runner's own requests since a reading are counted either way
    # (Replica.in_flight); only other clients' load can be this old.
    load_stale_s: float = Field(default=2.0, ge=0)
    load_timeout_s: float = Field(default=0.5, gt=0)
    down_for_s: float = Field(default=2.0, ge=0)  # how long a refusing replica is skipped
    # How long a replica that gave no first token in time is skipped before a probe (breaker.py);
    # doubled after each failed probe.
    suspect_for_s: float = Field(default=10.0, gt=0)
    # A conversation stays on its replica (its prefix cache) while that replica's load is at most
    # this factor of the pool's mean load (+1); 0 turns affinity off (least-loaded alone).
    affinity_load_factor: float = Field(default=1.5, ge=0)

    @model_validator(mode="after")
    def _default_pool_exists(self) -> PoolConfigBase:
        if self.default_pool is None:
            self.default_pool = next(iter(self.pools))
        elif self.default_pool not in self.pools:
            raise ValueError(f"default_pool {self.default_pool!r} is not one of the pools {list(self.pools)}")
        return self
