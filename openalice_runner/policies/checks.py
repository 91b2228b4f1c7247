"""Checks that span several fields of one rule or decision, each reported at the offending value.

What a rule's `pool:` must find in the routing file (the pool, a method it can serve, a tool-call
parser, a batch range within max_running_requests) is checked with both files:
pool_checks.py."""

from __future__ import annotations

from openalice_runner.config_files.errors import Problem
from openalice_runner.config_files.yaml_nodes import Located, Path
from openalice_runner.drafter_options import DRAFTER_OPTIONS, OPTION, OPTIONS_BY_METHOD, ngram_problem
from openalice_runner.policies.schema import Match, PlanSpec, Policy


def check_policy(policy: Policy, loc: Located) -> list[Problem]:
    problems: list[Problem] = []
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
        problems += _check_plan(rule, path, loc)
    problems += _check_plan(policy.default, ("default",), loc)
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


def _check_plan(d: PlanSpec, path: Path, loc: Located) -> list[Problem]:
    return _check_gamma(d, path, loc) + _check_options(d, path, loc) + _check_drafter(d, path, loc)


def _check_gamma(d: PlanSpec, path: Path, loc: Located) -> list[Problem]:
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
    return problems


def _check_options(d: PlanSpec, path: Path, loc: Located) -> list[Problem]:
    """Each option belongs to the method and sits within its limits (drafter_options.py)."""
    problems = []
    at = lambda *sub: (*path, *sub)  # noqa: E731
    allowed = OPTIONS_BY_METHOD[d.method]
    opts = d.options
    for f in opts.model_fields_set:
        if getattr(opts, f) is not None and f not in allowed:
            problems.append(
                loc.problem(at("options", f), f"option {f} does not apply to method {d.method}", key=True)
            )
    if d.method in OPTION["ngram_min"].methods and (wrong := ngram_problem(opts.ngram_min, opts.ngram_max)):
        problems.append(loc.problem(at("options", "ngram_max"), wrong))
    for option in DRAFTER_OPTIONS:
        if (wrong := option.problem(getattr(opts, option.name))) is not None:
            problems.append(loc.problem(at("options", option.name), wrong))
    if opts.eagle_tree and d.auto:
        # auto learns α per drafted token of a chain; a tree's acceptance counts every node
        problems.append(loc.problem(at("options", "eagle_tree"),
                                    "eagle_tree needs a fixed gamma (its depth cap), not gamma: auto"))
    return problems


def _check_drafter(d: PlanSpec, path: Path, loc: Located) -> list[Problem]:
    """What each method needs to draft with, refused here rather than by every request it matches."""
    problems = []
    opts = d.options
    if d.method == "eagle" and opts.eagle_head is None and d.pool is None:
        problems.append(
            loc.problem(path, "method eagle needs options.eagle_head (embedded engine) or pool (SGLang)")
        )
    if d.method == "draft":
        # the engine refuses what it cannot run: refused here too, not by every request it matches
        if opts.draft_model is not None:
            problems.append(loc.problem(
                (*path, "options", "draft_model"),
                "options.draft_model: the embedded engine has no separate draft models; it drafts from the "
                "target's first layers (options.draft_layers). SGLang and vLLM pools name their draft model "
                "in the routing file (launch)", key=True,
            ))  # fmt: skip
        elif opts.draft_layers is None:
            problems.append(loc.problem(
                path, "method draft needs options.draft_layers (the target's first N layers draft)"
            ))  # fmt: skip
    return problems
