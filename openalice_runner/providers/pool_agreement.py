"""Cross-file check: do a policy's SGLang pools and a routing file's SGLang pools describe the same servers?

The policy's `pools:` generate the launch flags (`policy sglang-args`); the routing file's pools
say where those servers are and repeat what the runner must know of their launch to read their
speculation figures (method, draft model, steps, adaptive candidates). `policy check FILE
--providers F` reports every disagreement at its place in the routing file (FILE:LINE:COL), and
every rule that names a pool no SGLang provider of the routing file has, at its place in the policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openalice_runner.config_files import ConfigError, Problem, load_located
from openalice_runner.policies.loader import load_policy_file
from openalice_runner.policies.sglang_args import compile_pool
from openalice_runner.providers.config import load_routing_text
from openalice_runner.providers.sglang import SGLangConfig, SGLangPool

_METHOD = {"EAGLE3": "eagle", "EAGLE": "eagle", "NGRAM": "ngram", "NONE": "off"}


def check_pools_agree(policy_file: str | Path, routing_file: str | Path) -> list[Problem]:
    """Problems between the two files; raises ConfigError (PolicyError, RoutingConfigError) if
    either is invalid on its own."""
    policy = load_policy_file(policy_file).policy
    policy_loc = load_located(Path(policy_file).read_text(), str(policy_file), empty="a policy")
    try:
        routing_text = Path(routing_file).read_text()
    except OSError as exc:
        raise ConfigError([Problem(str(routing_file), 1, 1, f"cannot read: {exc.strerror or exc}")]) from None
    routing = load_routing_text(routing_text, str(routing_file))
    routing_loc = load_located(routing_text, str(routing_file), empty="a routing file")

    deployed: dict[str, tuple[str, SGLangPool]] = {}
    for provider, cfg in routing.providers.items():
        if isinstance(cfg, SGLangConfig):
            for name, pool in cfg.pools.items():
                deployed.setdefault(name, (provider, pool))

    problems: list[Problem] = []
    decisions: list[tuple[tuple, Any]] = [(("rules", i), r) for i, r in enumerate(policy.rules)]
    decisions.append((("default",), policy.default))
    sglang_providers = {p for p, cfg in routing.providers.items() if isinstance(cfg, SGLangConfig)}
    for path, d in decisions:
        match = getattr(d, "match", None)
        named = match.provider if match is not None else None
        named = [named] if isinstance(named, str) else named
        if named is not None and not sglang_providers & set(named):
            continue  # the rule only fires for providers this file has not, or that are no SGLang
        if sglang_providers and d.pool is not None and d.pool not in deployed:
            known = ", ".join(sorted(deployed)) or "none"
            problems.append(
                policy_loc.problem(
                    (*path, "pool"),
                    f"pool {d.pool!r} is no pool of an SGLang provider in {routing_file} (pools there: {known})",
                )
            )
    for name, spec in policy.pools.items():
        if name not in deployed:
            continue  # defined for launching, not routed to by this file
        provider, routed = deployed[name]
        at = ("providers", provider, "pools", name)
        try:
            args = compile_pool(policy, name, "adaptive.json")
        except ValueError as exc:
            problems.append(policy_loc.problem(("pools", name), str(exc)))
            continue
        problems += _launch_problems(name, spec.algorithm, args, routed, at, routing_loc)
    return problems


def _launch_problems(name, algorithm, launch, routed: SGLangPool, at: tuple, loc) -> list[Problem]:
    a = launch.args

    def flag(f: str) -> str | None:
        return a[a.index(f) + 1] if f in a else None

    def as_int(value: str | None) -> int | None:
        return int(value) if value is not None else None

    expected: dict[str, Any] = {"method": _METHOD[algorithm]}
    if algorithm != "NONE":
        expected |= {
            "launch.draft_model_path": flag("--speculative-draft-model-path"),
            "launch.num_steps": as_int(flag("--speculative-num-steps")),
            "launch.num_draft_tokens": as_int(flag("--speculative-num-draft-tokens")),
            "launch.adaptive": "--speculative-adaptive" in a,
        }
    if launch.adaptive_config is not None:
        expected["launch.candidate_steps"] = sorted(
            {s for k, v in launch.adaptive_config.items() if k.isdigit() for s in v["candidate_steps"]}
        )
    problems = []
    for dotted, want in expected.items():
        obj: Any = routed
        for part in dotted.split("."):
            obj = getattr(obj, part)
        if obj != want:
            path = (*at, *dotted.split("."))
            problems.append(
                loc.problem(
                    path,
                    f"pool {name!r}: {dotted} is {obj!r}, but the policy launches it with {want!r} "
                    f"(`policy sglang-args --pool {name}`)",
                )
            )
    return problems
