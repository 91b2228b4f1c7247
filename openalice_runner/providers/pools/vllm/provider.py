"""vLLM provider: self-hosted vLLM servers grouped into pools, one speculation setting per pool.

The second dialect of the pool model (providers/pools/pool.py; SGLang is the first). What is vLLM's
(read from vLLM 0.32's source):
- load: GET /metrics, Prometheus `vllm:num_requests_running` and `vllm:num_requests_waiting`
  (v1/metrics/loggers.py; one sample per engine, summed). vLLM does not export its
  --max-num-seqs, so the cap the policy's batch size is held to is the launch's `max_num_seqs`.
- speculation figures: servers launched with `--per-request-spec-decode-metrics summary` answer
  `metrics.speculative_decoding` (generate/base/protocol.py SpeculativeDecodingMetrics:
  `num_spec_steps`, `num_accepted_draft_tokens`, `num_draft_tokens`, `acceptance_histogram`
  indexed by accepted drafts, `mean_acceptance_length`, `num_spec_tokens`) on the response, and
  when streaming on the final usage chunk (chat_completion/serving.py: only with
  `stream_options.include_usage`, which the runner always sets).
- requests: tool_choice "none" | "auto" | "required" | a named function (no allowed_tools form:
  sent as the allowed tools under the plain mode, as to SGLang); response_format and
  parallel_tool_calls pass through. Refusals are `{"error": {"message", "type", "param", "code"}}`
  with the field in `param` (VLLMValidationError), mapped to a 400 naming it.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import httpx
from pydantic import Field

from openalice_runner.providers.base import ProviderBadRequest, ProviderError
from openalice_runner.providers.pools.config import PoolBase, PoolConfigBase, plan_gamma
from openalice_runner.providers.pools.errors import error_param, http_error
from openalice_runner.providers.pools.pool import PoolProvider
from openalice_runner.providers.pools.replicas import Figures, LoadReader, parse_prometheus_sum
from openalice_runner.providers.pools.vllm.launch import VLLMLaunch
from openalice_runner.speculation import SpecMethod, SpeculationPlan
from openalice_runner.types import Usage

# ---------------------------------------------------------------- config


class VLLMPool(PoolBase):
    """One pool of a routing file: its servers and the flags they are launched with
    (`openalice-runner vllm args --pool P` prints the command line)."""

    launch: VLLMLaunch = Field(default_factory=VLLMLaunch)

    @property
    def method(self) -> SpecMethod:
        return self.launch.spec_method

    @property
    def adaptive(self) -> bool:
        """γ varies with the running batch: the launch leaves the per-batch table to the rules."""
        return self.method != "off" and self.launch.per_batch_size

    def gamma_for(self, plan: SpeculationPlan | None = None) -> int:
        """Draft tokens per verify step at most: the launch's num_speculative_tokens, else the
        deciding rule's γ (its upper bound), the most a step can draft for this request."""
        if self.method == "off":
            return 0
        if self.launch.num_speculative_tokens:
            return self.launch.num_speculative_tokens
        return plan_gamma(plan) or 0


class VLLMConfig(PoolConfigBase):
    type: Literal["vllm"]
    pools: dict[str, VLLMPool] = Field(min_length=1)


# ---------------------------------------------------------------- replica load


async def read_vllm_metrics(client: httpx.AsyncClient, url: str, timeout: float) -> Figures | None:
    resp = await client.get(f"{url}/metrics", timeout=timeout)
    if resp.status_code != 200:
        return None
    running = parse_prometheus_sum(resp.text, "vllm:num_requests_running")
    if running is None:
        return None
    return int(running), int(parse_prometheus_sum(resp.text, "vllm:num_requests_waiting") or 0), None


_LOAD_READERS: dict[str, LoadReader] = {"metrics": read_vllm_metrics}

# request fields vLLM names in refusals, longest first (a message without `param` names one)
_FIELDS = (
    "parallel_tool_calls",
    "response_format",
    "stream_options",
    "tool_choice",
    "max_tokens",
    "temperature",
    "messages",
    "tools",
    "top_p",
    "top_k",
    "seed",
    "stop",
)
_FIELD_RE = re.compile(r"\b(" + "|".join(_FIELDS) + r")\b")


# ---------------------------------------------------------------- provider


class VLLMProvider(PoolProvider):
    kind = "vllm"
    gen_ai_provider_name = "vllm"
    engine = "vLLM"
    config: VLLMConfig

    def __init__(self, name: str, config: VLLMConfig, client: httpx.AsyncClient | None = None) -> None:
        super().__init__(name, config, client)
        for pool_name, replicas in self.load_sources.items():
            cap = config.pools[pool_name].launch.max_num_seqs
            for replica in replicas:
                replica.max_running = cap  # vLLM's metrics do not carry --max-num-seqs

    def load_readers(self) -> dict[str, LoadReader]:
        return _LOAD_READERS

    def capture(self, ext: dict[str, Any], data: dict[str, Any]) -> None:
        metrics = data.get("metrics")
        if isinstance(metrics, dict) and isinstance(metrics.get("speculative_decoding"), dict):
            ext["spec"] = metrics["speculative_decoding"]

    def spec_figures(self, ext: dict[str, Any], pool: str, gamma: int, usage: Usage | None) -> dict[str, Any]:
        """From `metrics.speculative_decoding`. vLLM counts verify steps that drafted
        (`num_spec_steps`); a pass emits its accepted drafts plus one token, so the passes after
        prefill are completion − 1 − accepted (steps where the n-gram lookup found nothing
        decode without drafting)."""
        spec = ext.get("spec")
        if not spec:
            return {}
        try:
            steps = int(spec["num_spec_steps"])
            accepted = int(spec["num_accepted_draft_tokens"])
            proposed = int(spec["num_draft_tokens"])
            hist = tuple(int(x) for x in spec.get("acceptance_histogram") or ())
            mean_len = float(spec.get("mean_acceptance_length") or 0.0)
        except (KeyError, TypeError, ValueError):
            return {}
        if steps <= 0:
            return {}
        passes = max(steps, usage.completion_tokens - 1 - accepted) if usage is not None else steps
        return {
            "target_passes": passes,
            "accepted": accepted,
            "proposed": proposed,
            "accept_length_histogram": hist,
            "tokens_per_pass": mean_len or None,
            # vLLM counts the drafts it proposed (per-batch k, short n-gram matches included), so
            # α is accepted / proposed even where k varies: no `gamma_varies` estimate from rounds
            "gamma_varies": False,
        }

    def request_error(self, resp: httpx.Response) -> ProviderError:
        err = http_error(resp, self.name)
        if isinstance(err, ProviderBadRequest) and err.param:
            err.param = err.param.removeprefix("body.")  # FastAPI's location of a validation error
        if isinstance(err, ProviderBadRequest) and err.param is None:
            found = _FIELD_RE.search(err.message)
            err.param = found.group(1) if found else None
        if isinstance(err, ProviderBadRequest) and err.param and not err.message.startswith(err.param):
            err.message = f"{err.param}: {err.message}"
        return err


__all__ = ["VLLMConfig", "VLLMPool", "VLLMProvider", "error_param", "read_vllm_metrics"]
