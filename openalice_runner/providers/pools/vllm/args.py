"""A vLLM pool's server command line: the routing file's launch settings plus the rules routed to it.

vLLM, like SGLang, fixes speculation per server at launch (`--speculative-config` JSON), with at
most a table of γ by running batch size (`num_speculative_tokens_per_batch_size`, a list of
inclusive `[first, last, k]` ranges starting at 1; vLLM carries a range's k over gaps and past the
last range, and caps every k at num_speculative_tokens: v1/spec_decode/dynamic/utils.py). This is
the one generator of that line (`openalice-runner vllm args`):

* `--model` (the launch's model_path, else the provider's model) served as `--served-model-name`
  the provider's model, so requests name it.
* `--speculative-config`: method (`ngram`, `suffix`, `eagle`/`eagle3` and `draft_model` with their
  `model`), `num_speculative_tokens` (the launch's, else the largest γ of the rules routed to the
  pool), the n-gram lookup bounds (the launch's, else the rules' ngram_min/ngram_max), and the
  per-batch table cut where those rules' batch ranges start and end (`batch_table.py`, as for the
  engine's γ tables and SGLang's adaptive slots); a piece takes the largest γ of the rules that
  cover it (fixed γ, an auto rule's max_gamma, 0 for off). Left out when one γ holds throughout.
* `--per-request-spec-decode-metrics summary` with speculation (the per-request figures the
  provider reads), `--max-num-seqs`, `--max-model-len`, `--dtype`, `--enable-prefix-caching`,
  `--enable-prompt-tokens-details` (usage says how much of each prompt came from the prefix cache:
  the runner passes it on as `prompt_tokens_details.cached_tokens`), `--enable-auto-tool-choice
  --tool-call-parser`, `--reasoning-parser`, `--chat-template`.
Flag names and the JSON are checked with vLLM 0.32's own parser and SpeculativeConfig
(tests/policies/test_vllm_flags.py).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any

from openalice_runner.policies.batch_table import batch_segments, routed_to
from openalice_runner.policies.schema import PlanSpec, Policy, Rule
from openalice_runner.providers.pools.vllm.launch import VLLMLaunch

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_POLICY_METHOD = {"ngram": "ngram", "suffix": "suffix", "eagle": "eagle", "eagle3": "eagle", "draft_model": "draft"}


@dataclass(frozen=True)
class VLLMLaunchLine:
    pool: str
    args: list[str]  # the server's flags
    speculative_config: dict[str, Any] | None

    def line(self, python: str = "python") -> str:
        return shlex.join([python, "-m", SERVER_MODULE, *self.args])


def _top_gamma(d: PlanSpec | Rule, method: str) -> int:
    """The most a rule lets a step of this pool draft: 0 for off or another method."""
    if d.method == "off" or d.method != method:
        return 0
    return d.gamma_bounds[1]


def batch_schedule(
    routed: list[tuple[int, float, PlanSpec]], method: str, cap: int, max_num_seqs: int | None
) -> list[list[int]] | None:
    """`num_speculative_tokens_per_batch_size` for the rules routed to a pool; None when one γ
    holds throughout (or no rule says anything about batch sizes)."""
    pieces = [
        (lo, min(cap, max(_top_gamma(d, method) for d in covering)))
        for lo, covering in batch_segments(routed)
        if covering and (max_num_seqs is None or lo <= max_num_seqs)
    ]
    merged: list[tuple[int, int]] = []
    for lo, k in pieces:
        if not merged or merged[-1][1] != k:
            merged.append((lo, k))
    if len(merged) < 2:
        return None
    rows = []
    for i, (lo, k) in enumerate(merged):
        end = merged[i + 1][0] - 1 if i + 1 < len(merged) else max(lo, max_num_seqs or lo)
        rows.append([1 if i == 0 else lo, end, k])  # vLLM wants the first range to start at 1
    return rows


def compile_vllm_pool(
    launch: VLLMLaunch, pool_name: str, policy: Policy | None, model: str
) -> VLLMLaunchLine:
    """The server flags for one pool. ValueError where neither the launch nor the rules set γ."""
    routed = routed_to(policy, pool_name) if policy is not None else []
    args: list[str] = ["--model", launch.model_path or model, "--served-model-name", model]
    spec = _speculative_config(launch, pool_name, routed) if launch.method != "none" else None
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
        args += ["--per-request-spec-decode-metrics", "summary"]
    for flag, value in (
        ("--max-num-seqs", launch.max_num_seqs),
        ("--max-model-len", launch.max_model_len),
        ("--dtype", launch.dtype),
    ):
        if value is not None:
            args += [flag, str(value)]
    args.append("--enable-prefix-caching" if launch.enable_prefix_caching else "--no-enable-prefix-caching")
    args.append("--enable-prompt-tokens-details")
    if launch.tool_call_parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", launch.tool_call_parser]
    if launch.reasoning_parser:
        args += ["--reasoning-parser", launch.reasoning_parser]
    if launch.chat_template:
        args += ["--chat-template", launch.chat_template]
    args += list(launch.extra_args)
    return VLLMLaunchLine(pool_name, args, spec)


def _speculative_config(
    launch: VLLMLaunch, pool_name: str, routed: list[tuple[int, float, PlanSpec]]
) -> dict[str, Any]:
    """`--speculative-config` of a pool that speculates: γ (the launch's, else the rules' largest),
    the draft model, the n-gram bounds and the per-batch table."""
    policy_method = _POLICY_METHOD[launch.method]
    tops = [_top_gamma(d, policy_method) for _, _, d in routed]
    k = launch.num_speculative_tokens or max((t for t in tops if t > 0), default=None)
    if k is None:
        raise ValueError(
            f"pool {pool_name!r}: no rule routes to it with speculation on; set num_speculative_tokens"
        )
    spec: dict[str, Any] = {"method": launch.method, "num_speculative_tokens": k}
    if launch.draft_model:
        spec["model"] = launch.draft_model
    if launch.method == "ngram":
        spec.update(_ngram_bounds(launch, routed))
    if launch.per_batch_size:
        table = batch_schedule(routed, policy_method, k, launch.max_num_seqs)
        if table is not None:
            spec["num_speculative_tokens_per_batch_size"] = table
    return spec


def _ngram_bounds(launch: VLLMLaunch, routed: list[tuple[int, float, PlanSpec]]) -> dict[str, int]:
    """prompt_lookup_min / _max: the launch's, else the n-gram sizes the rules give."""
    lo, hi = launch.prompt_lookup_min, launch.prompt_lookup_max
    if lo is None and hi is None:  # the rules' n-gram sizes, where they give them
        sizes = [(d.options.ngram_min, d.options.ngram_max) for _, _, d in routed if d.method == "ngram"]
        mins = [a for a, _ in sizes if a is not None]
        maxs = [b for _, b in sizes if b is not None]
        lo = min(mins) if mins else None
        hi = max(maxs) if maxs else None
    out: dict[str, int] = {}
    if lo is not None:
        out["prompt_lookup_min"] = lo
    if hi is not None:
        out["prompt_lookup_max"] = max(hi, lo or hi)
    return out
