"""SGLang provider: self-hosted SGLang servers grouped into pools, one speculation setting per pool.

The pool model (routing by the plan's pool, replica choice, the attempt loop) is shared with
vLLM (providers/pools/pool.py); this is SGLang's dialect. Replica load comes from the server itself,
cached for `load_cache_s`:
  GET /v1/loads?include=core   -> {"loads": [{"dp_rank", "num_running_reqs", "num_waiting_reqs", ...}]}
  GET /metrics                 -> Prometheus `sglang:num_running_reqs`, `sglang:num_queue_reqs`
                                  (only on servers launched with --enable-metrics)
the first that answers is remembered per replica (SGLang 0.5.23 has no /get_load route).
`num_running_reqs` is SGLang's running decode batch, capped by --max-running-requests; it is what
an adaptive pool picks its `--speculative-adaptive-config` slot by.

Requests go to `/v1/chat/completions` (OpenAI-compatible, read by `openai_wire`) with
`return_spec_tokens_details`: SGLang 0.5.23 then sends the speculation counters as
`sglext.spec_tokens_details` on the response, or on a chunk of its own after the finish chunk when
streaming (serving_chat.py). SGLang errors are `{"object": "error", "message", "type", "param",
"code"}` (non-streaming) or an SSE `data: {"error": {...}}` event (streaming).
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import httpx
from pydantic import Field

from openalice_runner.providers import openai_wire as wire
from openalice_runner.providers.base import CallContext
from openalice_runner.providers.pools.config import PoolBase, PoolConfigBase, plan_gamma
from openalice_runner.providers.pools.pool import PoolProvider
from openalice_runner.providers.pools.replicas import Figures, LoadReader, Replica, parse_prometheus_sum
from openalice_runner.providers.pools.sglang.launch import SGLangLaunch
from openalice_runner.speculation import SpecMethod, SpeculationPlan
from openalice_runner.types import ChatRequest, Usage

__all__ = ["Replica", "SGLangConfig", "SGLangPool", "SGLangProvider", "parse_prometheus_sum"]

# ---------------------------------------------------------------- config


class SGLangPool(PoolBase):
    """One pool of a routing file: where its servers are, and every flag they are launched with
    (`openalice-runner sglang args --pool P` prints them; the routing file is their one source)."""

    launch: SGLangLaunch = Field(default_factory=SGLangLaunch)

    @property
    def method(self) -> SpecMethod:
        return self.launch.method

    @property
    def adaptive(self) -> bool:
        return self.method != "off" and self.launch.adaptive

    def gamma_for(self, plan: SpeculationPlan | None = None) -> int:
        """Draft tokens per verify round (SGLang counts the target's own token in num_draft_tokens).
        Where the launch leaves it to the rules (an adaptive pool's steps vary per running batch;
        a pool without num_steps/num_draft_tokens took its γ from the rules routed to it), the
        deciding rule's γ: its upper bound, the most one round can draft for this request."""
        if self.method == "off":
            return 0
        launch = self.launch
        if not self.adaptive:
            if launch.num_draft_tokens:
                return launch.num_draft_tokens - 1
            if launch.num_steps:
                return launch.num_steps
        gamma = plan_gamma(plan)
        return gamma if gamma is not None else (launch.num_steps or 0)


class SGLangConfig(PoolConfigBase):
    type: Literal["sglang"]
    pools: dict[str, SGLangPool] = Field(min_length=1)


# ---------------------------------------------------------------- replica load


async def _read_v1_loads(client: httpx.AsyncClient, url: str, timeout: float) -> Figures | None:
    resp = await client.get(f"{url}/v1/loads", params={"include": "core"}, timeout=timeout)
    if resp.status_code != 200:
        return None
    loads = resp.json()["loads"]
    limits = [int(x["max_running_requests"]) for x in loads if x.get("max_running_requests")]
    return (
        sum(int(x.get("num_running_reqs") or 0) for x in loads),
        sum(int(x.get("num_waiting_reqs") or 0) for x in loads),
        sum(limits) if limits and len(limits) == len(loads) else None,
    )


async def _read_metrics(client: httpx.AsyncClient, url: str, timeout: float) -> Figures | None:
    resp = await client.get(f"{url}/metrics", timeout=timeout)
    if resp.status_code != 200:
        return None
    running = parse_prometheus_sum(resp.text, "sglang:num_running_reqs")
    if running is None:
        return None
    return int(running), int(parse_prometheus_sum(resp.text, "sglang:num_queue_reqs") or 0), None


_LOAD_READERS: dict[str, LoadReader] = {"v1_loads": _read_v1_loads, "metrics": _read_metrics}


# ---------------------------------------------------------------- provider


class SGLangProvider(PoolProvider):
    kind = "sglang"
    gen_ai_provider_name = "sglang"
    engine = "SGLang"
    config: SGLangConfig

    def load_readers(self) -> dict[str, LoadReader]:
        return _LOAD_READERS

    def body(self, request: ChatRequest, stream: bool, ctx: CallContext | None = None) -> dict[str, Any]:
        body = super().body(request, stream, ctx)
        # SGLang 0.5.23 returns the per-request speculation counters as `sglext.spec_tokens_details`
        # (protocol.py SpecTokensDetails), on the response or, streaming, on a chunk of their own
        # after the finish chunk (serving_chat.py `_generate_chat_stream`). Nothing when off.
        body["return_spec_tokens_details"] = True
        return body

    def capture(self, ext: dict[str, Any], data: dict[str, Any]) -> None:
        """`sglext.spec_tokens_details` (asked for), else the same names in a choice's `meta_info`
        (present when a caller set `return_meta_info`)."""
        if data.get("sglext") is not None:
            try:
                spec = wire.WireSglExt.model_validate(data["sglext"]).spec()
            except ValueError:
                spec = None
            if spec is not None:
                ext["spec"] = spec
        if "spec" in ext:
            return
        for choice in data.get("choices") or ():
            meta = choice.get("meta_info") if isinstance(choice, dict) else None
            if meta and meta.get("spec_verify_ct"):
                with contextlib.suppress(ValueError):
                    ext["spec"] = wire.WireSpecDetails.model_validate(meta)
                return

    def spec_figures(self, ext: dict[str, Any], pool: str, gamma: int, usage: Usage | None) -> dict[str, Any]:
        """The outcome from SGLang 0.5.23's per-request counters, read under SGLang's own names (the
        foreign wire; the runner's names are `SpeculationOutcome`'s) (tokenizer_manager.py
        `_calculate_spec_decoding_metrics`): `spec_verify_ct` verify passes,
        `spec_num_correct_drafts` accepted drafts, `spec_correct_drafts_histogram[k]` passes that
        accepted k drafts (as long as the largest k seen + 1), `spec_accept_length` completion
        tokens per pass, and `spec_num_proposed_drafts` = verify_ct × (launch num_draft_tokens − 1).
        On an adaptive pool a pass drafts 0..max steps, so that last figure is not what was
        proposed: the outcome says `gamma_varies` and the policy takes α from the histogram."""
        spec: wire.WireSpecDetails | None = ext.get("spec")
        if spec is None or spec.spec_verify_ct <= 0:
            return {}
        verify_ct = spec.spec_verify_ct
        hist = list(spec.spec_correct_drafts_histogram)
        if hist and gamma and len(hist) < gamma + 1:
            hist += [0] * (gamma + 1 - len(hist))  # SGLang grows it only as far as seen
        return {
            "target_passes": verify_ct,
            "accepted": spec.spec_num_correct_drafts,
            "proposed": spec.spec_num_proposed_drafts,
            "accept_length_histogram": tuple(hist),
            "tokens_per_pass": spec.spec_accept_length
            or (usage.completion_tokens / verify_ct if usage is not None else None),
            "gamma_varies": self.config.pools[pool].adaptive,
        }
