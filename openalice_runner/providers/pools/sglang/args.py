"""An SGLang pool's launch flags: the routing file's launch settings plus the policy rules routed to it.

SGLang fixes speculation per server at launch, so the runner realises a policy by routing requests
among pools. The routing file owns each pool's launch settings (`providers.P.pools.NAME.launch`,
providers/pools/sglang/launch.py); what only the policy knows comes from the rules that name the pool:
the adaptive pool's per-batch step candidates, and γ where the launch leaves it out. This is the one
flag generator (`openalice-runner sglang args`). Flag names and constraints follow SGLang 0.5.x
`server_args` (checked against 0.5.23, see tests/policies/test_sglang_flags.py):

* `--speculative-algorithm EAGLE3|EAGLE|NGRAM`, `--speculative-draft-model-path` (EAGLE head).
* EAGLE with `--speculative-eagle-topk 1` is a chain: SGLang forces num_draft_tokens = num_steps + 1.
* `--speculative-adaptive` (EAGLE/EAGLE3, topk 1 only) with `--speculative-adaptive-config PATH`:
  a JSON *file* whose integer-string keys are batch sizes, each `{"candidate_steps": [...]}`;
  SGLang routes a batch to the largest key <= its size, and steps 0 means no speculation.
  Top-level non-numeric keys (e.g. "ema_alpha") are defaults for every slot. `--speculative-num-steps`
  must be one of the candidates. Here the batch axis is cut where the ranges of the rules routed to
  the pool start and end (`batch_table.py`, as for the engine's γ tables), and each piece's key holds
  the candidates of every rule covering it: fixed γ -> [γ], auto -> spread over [min_gamma, max_gamma],
  off -> [0].
* `--model-path` is the provider's `model`; `--tool-call-parser`, `--reasoning-parser` (serving:
  SGLang parses tool calls / reasoning out of the text only with them) and `--max-running-requests`
  (scheduling: the largest running batch, which bounds the adaptive slots a pool's rules can reach)
  come from the launch settings as they are.
* NGRAM drafts a tree: `--speculative-num-draft-tokens` is its size (we use max γ + 1),
  `--speculative-ngram-{min,max}-bfs-breadth|match-type|max-trie-depth|capacity` tune it.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from openalice_runner.policies.batch_table import batch_segments, routed_to
from openalice_runner.policies.schema import AdaptiveSettings, PlanSpec, Policy, Rule
from openalice_runner.providers.pools.sglang.launch import SGLangLaunch


@dataclass(frozen=True)
class SGLangLaunchLine:
    """One pool's compiled server flags (and adaptive config), as vllm_args.VLLMLaunchLine."""

    pool: str
    args: list[str]
    adaptive_config: dict | None  # JSON content for --speculative-adaptive-config, when adaptive
    adaptive_config_path: str | None

    def line(self) -> str:
        return shlex.join(self.args)

    def write_adaptive_config(self) -> Path | None:
        if self.adaptive_config is None or self.adaptive_config_path is None:
            return None
        path = Path(self.adaptive_config_path)
        path.write_text(json.dumps(self.adaptive_config, indent=2) + "\n")
        return path


def gamma_candidates(lo: int, hi: int) -> list[int]:
    """Step candidates for an auto range: every value when narrow, else every other one plus the ends.

    Each candidate costs SGLang a CUDA-graph set, so wide ranges are thinned (1..7 -> 1,3,5,7).
    """
    if hi - lo <= 3:
        return list(range(lo, hi + 1))
    return sorted({*range(lo, hi + 1, 2), hi})


def _steps_of(d: PlanSpec | Rule) -> list[int]:
    if d.method == "off":
        return [0]
    lo, hi = d.gamma_bounds
    return gamma_candidates(lo, hi) if d.auto else [lo]


def compile_pool(
    pool: SGLangLaunch,
    pool_name: str,
    policy: Policy | None,
    adaptive_config_path: str | None = None,
    model: str | None = None,
) -> SGLangLaunchLine:
    """Launch flags for one pool, from its launch settings (routing file) and the rules of `policy`
    that name it (None: no rules). `model` leads the line as --model-path. Raises ValueError where
    neither the settings nor the rules set γ, or where the settings contradict the rules."""
    routed = routed_to(policy, pool_name) if policy is not None else []
    ema_weight = (policy.adaptive if policy is not None else AdaptiveSettings()).ema_weight
    positive = [s for s in sorted({s for _, _, d in routed for s in _steps_of(d)}) if s > 0]
    args: list[str] = ["--model-path", model] if model else []
    adaptive_cfg: dict | None = None
    cfg_path: str | None = None
    if pool.algorithm in ("EAGLE", "EAGLE3"):
        if pool.adaptive:
            steps, adaptive_cfg = _adaptive_steps(pool, pool_name, routed, positive, ema_weight)
            cfg_path = adaptive_config_path or pool.adaptive_config_path or f"sglang-adaptive-{pool_name}.json"
            draft_tokens = steps + 1
        else:
            steps = _launch_steps(pool, pool_name, max(positive) if positive else None)
            draft_tokens = pool.num_draft_tokens if pool.num_draft_tokens is not None else steps + 1
        args += ["--speculative-algorithm", pool.algorithm]
        args += ["--speculative-draft-model-path", str(pool.draft_model_path)]
        args += ["--speculative-num-steps", str(steps)]
        args += ["--speculative-eagle-topk", str(pool.eagle_topk or 1)]
        args += ["--speculative-num-draft-tokens", str(draft_tokens)]
        if pool.adaptive:
            args += ["--speculative-adaptive", "--speculative-adaptive-config", str(cfg_path)]
    elif pool.algorithm == "NGRAM":
        args += _ngram_args(pool, pool_name, positive)
    for flag, value in (
        ("--tool-call-parser", pool.tool_call_parser),
        ("--reasoning-parser", pool.reasoning_parser),
        ("--max-running-requests", pool.max_running_requests),
    ):
        if value is not None:
            args += [flag, str(value)]
    args += list(pool.extra_args)
    return SGLangLaunchLine(pool_name, args, adaptive_cfg, cfg_path)


def _launch_steps(pool: SGLangLaunch, pool_name: str, from_rules: int | None) -> int:
    """An EAGLE pool's --speculative-num-steps: its own num_steps, else `from_rules` (the step
    count its rules route to it; None: no rule routes to it with speculation on)."""
    if pool.num_steps is not None:
        return pool.num_steps
    if from_rules is None:
        raise ValueError(f"pool {pool_name!r}: no rule routes to it with speculation on; set num_steps")
    return from_rules


def _adaptive_steps(
    pool: SGLangLaunch, pool_name: str, routed: list[tuple[int, float, PlanSpec]], positive: list[int],
    ema_weight: float,
) -> tuple[int, dict]:
    """An adaptive EAGLE pool's launch steps and its `--speculative-adaptive-config` content."""
    # the same batch pieces the engine's γ tables come from; a piece holds every
    # candidate of the rules that cover it (the pool serves all their turn types)
    slots: dict[int, set[int]] = {
        lo: {s for d in covering for s in _steps_of(d)} for lo, covering in batch_segments(routed) if covering
    }
    steps = _launch_steps(pool, pool_name, positive[len(positive) // 2] if positive else None)
    if not slots:
        slots[1] = {steps}
    union = sorted(set().union(*slots.values()))
    if steps not in union:
        raise ValueError(f"pool {pool_name!r}: num_steps {steps} is not among the rules' candidates {union}")
    adaptive_cfg: dict = {"ema_alpha": ema_weight}
    for lo in sorted(slots):
        adaptive_cfg[str(lo)] = {"candidate_steps": sorted(slots[lo])}
    return steps, adaptive_cfg


def _ngram_args(pool: SGLangLaunch, pool_name: str, positive: list[int]) -> list[str]:
    if pool.num_draft_tokens is not None:
        draft_tokens = pool.num_draft_tokens
    elif positive:
        draft_tokens = max(positive) + 1
    else:
        raise ValueError(f"pool {pool_name!r}: no rule routes to it with speculation on; set num_draft_tokens")
    args = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(draft_tokens)]
    if pool.num_steps is not None:
        args += ["--speculative-num-steps", str(pool.num_steps)]
    ng = pool.ngram
    if ng is not None:
        for field, flag in (
            ("min_bfs_breadth", "--speculative-ngram-min-bfs-breadth"),
            ("max_bfs_breadth", "--speculative-ngram-max-bfs-breadth"),
            ("match_type", "--speculative-ngram-match-type"),
            ("max_trie_depth", "--speculative-ngram-max-trie-depth"),
            ("capacity", "--speculative-ngram-capacity"),
        ):
            value = getattr(ng, field)
            if value is not None:
                args += [flag, str(value)]
    return args
