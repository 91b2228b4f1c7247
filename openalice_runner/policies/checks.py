"""Checks that span several fields of one rule, decision or pool, each reported at the offending value."""

from __future__ import annotations

from openalice_runner.config_files.errors import Problem
from openalice_runner.config_files.yaml_nodes import Located, Path
from openalice_runner.policies.schema import OPTIONS_BY_METHOD, DecisionSpec, Match, Policy, SGLangPool

# Which rule methods each SGLang pool algorithm can serve (`off` everywhere: adaptive steps 0 or no spec).
POOL_METHODS = {
    "EAGLE3": {"eagle", "off"},
    "EAGLE": {"eagle", "off"},
    "NGRAM": {"ngram", "off"},
    "NONE": {"off"},
}


def check_policy(policy: Policy, loc: Located) -> list[Problem]:
    problems: list[Problem] = []
    for name, pool in policy.pools.items():
        problems += _check_pool(pool, ("pools", name), loc)
    seen: dict[str, int] = {}
    for i, rule in enumerate(policy.rules):
        path: Path = ("rules", i)
        if not rule.name.strip():
            problems.append(loc.problem((*path, "name"), "rule name must not be empty"))
        elif rule.name in seen:
            problems.append(
                loc.problem(
                    (*path, "name"), f"duplicate rule name {rule.name!r} (also rules[{seen[rule.name]}])"
                )
            )
        else:
            seen[rule.name] = i
        problems += _check_match(rule.match, (*path, "match"), loc)
        problems += _check_decision(rule, path, policy, loc)
    problems += _check_decision(policy.default, ("default",), policy, loc)
    return problems


def _check_match(match: Match, path: Path, loc: Located) -> list[Problem]:
    problems = []
    if all(getattr(match, f) is None for f in ("turn_type", "batch_size", "provider", "model")):
        problems.append(
            loc.problem(
                path, "match has no conditions, so it matches everything: put that decision under `default:`"
            )
        )
    for field in ("turn_type", "provider", "model"):
        value = getattr(match, field)
        values = [value] if isinstance(value, str) else (value or [])
        if isinstance(value, list) and not value:
            problems.append(loc.problem((*path, field), f"{field}: empty list matches nothing"))
        for j, v in enumerate(values):
            if not v.strip():
                sub = (*path, field) if isinstance(value, str) else (*path, field, j)
                problems.append(loc.problem(sub, f"{field}: empty name"))
    b = match.batch_size
    if b is not None and b.max is not None and b.max < b.min:
        problems.append(loc.problem((*path, "batch_size", "max"), f"batch_size: max {b.max} < min {b.min}"))
    return problems


def _check_decision(d: DecisionSpec, path: Path, policy: Policy, loc: Located) -> list[Problem]:
    problems = []
    at = lambda *sub: (*path, *sub)  # noqa: E731
    if d.method == "off":
        if d.gamma not in (None, 0):
            problems.append(loc.problem(at("gamma"), "gamma must be omitted (or 0) when method is off"))
    elif d.gamma is None:
        problems.append(loc.problem(path, f"method {d.method} needs gamma: an integer 1..64 or auto"))
    elif d.gamma == 0:
        problems.append(
            loc.problem(at("gamma"), f"gamma 0 means no speculation: use method off instead of {d.method}")
        )
    if d.gamma != "auto":
        for f in ("min_gamma", "max_gamma", "prior_alpha"):
            if getattr(d, f) is not None:
                problems.append(loc.problem(at(f), f"{f} only applies with gamma: auto"))
    elif d.gamma_bounds[0] > d.gamma_bounds[1]:
        problems.append(
            loc.problem(at("max_gamma"), f"max_gamma {d.gamma_bounds[1]} < min_gamma {d.gamma_bounds[0]}")
        )

    allowed = OPTIONS_BY_METHOD[d.method]
    opts = d.options
    for f in opts.model_fields_set:
        if getattr(opts, f) is not None and f not in allowed:
            problems.append(
                loc.problem(at("options", f), f"option {f} does not apply to method {d.method}", key=True)
            )
    lo, hi = opts.ngram_min or 1, opts.ngram_max or 4
    if d.method in ("ngram", "eagle") and lo > hi:
        problems.append(loc.problem(at("options", "ngram_max"), f"ngram_max {hi} < ngram_min {lo}"))
    if opts.eagle_tree == 1:
        problems.append(loc.problem(at("options", "eagle_tree"),
                                    "eagle_tree is 0 (chains) or a tree of 2 to 63 tokens, got 1"))
    if opts.eagle_tree and d.auto:
        # auto learns α per drafted token of a chain; a tree's acceptance counts every node
        problems.append(loc.problem(at("options", "eagle_tree"),
                                    "eagle_tree needs a fixed gamma (its depth cap), not gamma: auto"))
    if d.method == "eagle" and opts.eagle_head is None and d.pool is None:
        problems.append(
            loc.problem(path, "method eagle needs options.eagle_head (embedded engine) or pool (SGLang)")
        )
    if d.method == "draft":
        if opts.draft_model is None and opts.draft_layers is None:
            problems.append(
                loc.problem(path, "method draft needs options.draft_model or options.draft_layers")
            )
        elif opts.draft_model is not None and opts.draft_layers is not None:
            problems.append(
                loc.problem(
                    at("options"), "set one of options.draft_model and options.draft_layers, not both"
                )
            )

    if d.pool is not None:
        pool = policy.pools.get(d.pool)
        if pool is None:
            known = ", ".join(sorted(policy.pools)) or "none defined"
            problems.append(loc.problem(at("pool"), f"unknown pool {d.pool!r} (pools: {known})"))
        elif d.method not in POOL_METHODS[pool.algorithm]:
            problems.append(
                loc.problem(
                    at("method"), f"method {d.method} cannot be served by pool {d.pool!r} ({pool.algorithm})"
                )
            )
        else:
            problems += _check_routed_to_pool(d, path, d.pool, pool, loc)
    return problems


def _check_routed_to_pool(
    d: DecisionSpec, path: Path, name: str, pool: SGLangPool, loc: Located
) -> list[Problem]:
    """What a pool must offer the turns and batch sizes routed to it."""
    problems = []
    match = getattr(d, "match", None)  # the default decision matches every turn and batch size
    turns = match.turn_type if match is not None else None
    serves_tools = turns is None or "tool_call" in ([turns] if isinstance(turns, str) else turns)
    if serves_tools and not pool.tool_call_parser:
        problems.append(
            loc.problem(
                (*path, "pool"),
                f"pool {name!r} serves tool_call turns but has no tool_call_parser: SGLang returns tool "
                "calls as text unless launched with --tool-call-parser",
            )
        )
    limit = pool.max_running_requests
    if pool.adaptive and limit is not None and match is not None:
        b = match.batch_size
        top = b.max if b is not None else None
        if top is None or top > limit:
            where = (*path, "match", "batch_size") if b is not None else (*path, "match")
            reach = f"reaches {top}" if top is not None else "has no upper bound"
            problems.append(
                loc.problem(
                    where,
                    f"batch_size {reach}, but adaptive pool {name!r} runs at most "
                    f"max_running_requests {limit} (SGLang picks the adaptive slot from its running "
                    f"requests): bound it with max: {limit} or below",
                )
            )
    return problems


def _check_pool(pool: SGLangPool, path: Path, loc: Located) -> list[Problem]:
    problems = []
    at = lambda *sub: (*path, *sub)  # noqa: E731
    eagle = pool.algorithm in ("EAGLE", "EAGLE3")
    if eagle and not pool.draft_model_path:
        problems.append(loc.problem(path, f"{pool.algorithm} pool needs draft_model_path (the EAGLE head)"))
    if not eagle:
        for f in ("draft_model_path", "eagle_topk"):
            if getattr(pool, f) is not None:
                problems.append(
                    loc.problem(at(f), f"{f} does not apply to a {pool.algorithm} pool", key=True)
                )
    if pool.algorithm == "NONE":
        for f in ("num_steps", "num_draft_tokens", "ngram"):
            if getattr(pool, f) is not None:
                problems.append(
                    loc.problem(at(f), f"{f} does not apply to a pool without speculation", key=True)
                )
    if pool.ngram is not None and pool.algorithm != "NGRAM":
        problems.append(loc.problem(at("ngram"), "ngram options only apply to an NGRAM pool", key=True))
    if pool.adaptive and pool.max_running_requests is None:
        problems.append(
            loc.problem(
                path,
                "an adaptive pool needs max_running_requests: the largest batch its slots see "
                "(SGLang's own default depends on GPU memory)",
            )
        )
    if pool.adaptive:
        if not eagle:
            problems.append(
                loc.problem(at("adaptive"), "SGLang's adaptive speculation supports EAGLE/EAGLE3 only")
            )
        elif pool.eagle_topk not in (None, 1):
            problems.append(loc.problem(at("eagle_topk"), "SGLang's adaptive speculation needs eagle_topk 1"))
        if pool.num_draft_tokens is not None:
            problems.append(
                loc.problem(
                    at("num_draft_tokens"),
                    "with adaptive, SGLang sets num_draft_tokens to num_steps + 1",
                    key=True,
                )
            )
    elif pool.adaptive_config_path is not None:
        problems.append(
            loc.problem(at("adaptive_config_path"), "adaptive_config_path needs adaptive: true", key=True)
        )
    topk = pool.eagle_topk or 1
    if (
        eagle
        and topk == 1
        and pool.num_steps is not None
        and pool.num_draft_tokens not in (None, pool.num_steps + 1)
    ):
        problems.append(
            loc.problem(
                at("num_draft_tokens"),
                f"with eagle_topk 1 SGLang uses num_draft_tokens = num_steps + 1 = {pool.num_steps + 1}",
            )
        )
    if eagle and topk > 1 and pool.num_draft_tokens is None:
        problems.append(
            loc.problem(path, "eagle_topk > 1 builds a draft tree: set num_draft_tokens (its size)")
        )
    ng = pool.ngram
    if ng and ng.min_bfs_breadth and ng.max_bfs_breadth and ng.min_bfs_breadth > ng.max_bfs_breadth:
        problems.append(loc.problem(at("ngram", "max_bfs_breadth"), "max_bfs_breadth < min_bfs_breadth"))
    return problems
