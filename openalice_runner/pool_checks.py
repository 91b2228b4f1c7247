"""Cross-file checks: a policy's rules against the SGLang and vLLM pools a routing file deploys.

It reads both files, so it sits above both (policies/ and providers/), beside the runner that loads them.

The routing file owns each pool (replicas and launch settings); a policy rule only names one
(`pool:`). What a rule needs of the pool it names is checked with both files, at load
(`Runner.from_config` with both as files) and by `policy check POLICY --providers F`, each problem
at the offending value (FILE:LINE:COL):

- the pool exists in an SGLang or vLLM provider of the routing file (rules that only fire for
  providers the file lacks, or that have no pools, are not held against it);
- the rule's method is one the pool's algorithm serves;
- a pool serving tool_call turns (a rule naming it whose `turn_type` includes `tool_call` or is
  absent, the policy's default plan, or a provider's default_pool) has a tool_call_parser;
- on an adaptive SGLang pool, a rule's batch range stays within max_running_requests (SGLang
  picks the adaptive slot from its running requests, which never pass it); on a vLLM pool with
  max_num_seqs, a rule's range neither starts nor ends past it (its running batch never does);
- the flags of a pool the rules route to can be generated (providers/pools/sglang/args.py,
  providers/pools/vllm/args.py), e.g. an adaptive pool's num_steps among the rules' candidates;
- an EAGLE pool's head (SGLang `draft_model_path`, vLLM `draft_model` of an eagle/eagle3 pool),
  where it is a folder on this machine, was trained for the model the pool serves
  (head_folders.py): the runner's fingerprint against the model's name, and where the model is a
  local folder its hidden size, vocabulary and layer count; a head from elsewhere (no fingerprint)
  against the hidden and vocabulary sizes alone, which a note says. A path that is no folder here
  (a hub id, a path on the serving host) is the engine's to resolve.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from openalice_runner.config_files import ConfigError, Located, Problem, load_located
from openalice_runner.head_folders import (
    DEFAULT_MODEL_NAME,
    OWN_KEY,
    HeadTarget,
    ModelShape,
    model_shape,
    read_head_target,
)
from openalice_runner.policies.errors import PolicyError
from openalice_runner.policies.loader import parse_policy
from openalice_runner.policies.schema import PlanSpec, Policy, Rule
from openalice_runner.providers.config import RoutingConfig, RoutingConfigError, load_routing_text
from openalice_runner.providers.pools.pool import PoolConfigBase
from openalice_runner.providers.pools.sglang.args import SGLangLaunchLine, compile_pool
from openalice_runner.providers.pools.sglang.launch import SERVES, SGLangLaunch
from openalice_runner.providers.pools.sglang.provider import SGLangConfig, SGLangPool
from openalice_runner.providers.pools.vllm.args import VLLMLaunchLine, compile_vllm_pool
from openalice_runner.providers.pools.vllm.launch import EMBEDDED_MODEL, VLLMLaunch
from openalice_runner.providers.pools.vllm.launch import SERVES as VLLM_SERVES
from openalice_runner.providers.pools.vllm.provider import VLLMConfig, VLLMPool

ENGINE = {"sglang": "SGLang", "vllm": "vLLM"}


@dataclass(frozen=True)
class DeployedPool:
    provider: str
    name: str
    pool: SGLangPool | VLLMPool
    model: str
    dialect: str = "sglang"  # sglang | vllm

    @property
    def path(self) -> tuple:
        return ("providers", self.provider, "pools", self.name)

    @property
    def engine(self) -> str:
        return ENGINE[self.dialect]


def deployed_pools(routing: RoutingConfig, dialect: str | None = None) -> list[DeployedPool]:
    return [
        DeployedPool(provider, name, pool, cfg.model, cfg.type)
        for provider, cfg in routing.providers.items()
        if isinstance(cfg, SGLangConfig | VLLMConfig) and dialect in (None, cfg.type)
        for name, pool in cfg.pools.items()
    ]


def find_pool(
    routing: RoutingConfig, pool: str, provider: str | None = None, dialect: str = "sglang"
) -> DeployedPool:
    """The `dialect` pool named `pool` (of `provider`, when given). KeyError naming what there is otherwise."""
    pools = deployed_pools(routing, dialect)
    engine = ENGINE[dialect]
    found = [p for p in pools if p.name == pool and provider in (None, p.provider)]
    if not found:
        known = ", ".join(sorted({f"{p.provider}.{p.name}" for p in pools})) or "none"
        raise KeyError(f"unknown pool {pool!r} ({engine} pools in the routing file: {known})")
    if len(found) > 1:
        raise KeyError(
            f"pool {pool!r} is in several {engine} providers ({', '.join(p.provider for p in found)}): "
            "name one with --provider"
        )
    return found[0]


def pool_launch(
    deployed: DeployedPool, policy: Policy | None, adaptive_config_path: str | None = None
) -> SGLangLaunchLine:
    """The one flag generator's output for a deployed SGLang pool (ValueError where it cannot be made)."""
    launch = deployed.pool.launch
    if not isinstance(launch, SGLangLaunch):
        raise TypeError(f"pool {deployed.name!r} is a {deployed.engine} pool, not an SGLang one")
    return compile_pool(launch, deployed.name, policy, adaptive_config_path, deployed.model)


def vllm_pool_launch(deployed: DeployedPool, policy: Policy | None) -> VLLMLaunchLine:
    """The vLLM server flags for a deployed vLLM pool (ValueError where they cannot be made)."""
    launch = deployed.pool.launch
    if not isinstance(launch, VLLMLaunch):
        raise TypeError(f"pool {deployed.name!r} is a {deployed.engine} pool, not a vLLM one")
    return compile_vllm_pool(launch, deployed.name, policy, deployed.model)


def _compile(deployed: DeployedPool, policy: Policy) -> None:
    if deployed.dialect == "vllm":
        vllm_pool_launch(deployed, policy)
    else:
        pool_launch(deployed, policy, "adaptive.json")


def check_pool_files(
    policy_file: str | Path, routing_file: str | Path, notes: list[Problem] | None = None
) -> list[Problem]:
    """Problems between the two files; raises ConfigError (PolicyError, RoutingConfigError) if
    either is invalid on its own. `notes` gets what was checked less than fully (a head from
    elsewhere: its sizes only)."""
    policy_text = _read(policy_file, PolicyError)
    routing_text = _read(routing_file, RoutingConfigError)
    policy = parse_policy(policy_text, str(policy_file))
    routing = load_routing_text(routing_text, str(routing_file))
    policy_loc = load_located(policy_text, str(policy_file), empty="a policy")
    routing_loc = load_located(routing_text, str(routing_file), empty="a routing file")
    return check_pools(policy, policy_loc, routing, routing_loc, notes)


def check_pools(
    policy: Policy, policy_loc: Located, routing: RoutingConfig, routing_loc: Located,
    notes: list[Problem] | None = None,
) -> list[Problem]:
    pools = deployed_pools(routing)
    if not pools:
        return []  # no pool provider: the rules' pools never come into play
    head_notes: list[Problem] = notes if notes is not None else []
    sglang_providers = {p.provider for p in pools}
    problems: list[Problem] = []
    named_pools: set[tuple[str, str]] = set()  # (provider, pool) some rule sends requests to
    plans: list[tuple[tuple, PlanSpec]] = [(("rules", i), r) for i, r in enumerate(policy.rules)]
    plans.append((("default",), policy.default))
    for path, d in plans:
        if d.pool is None:
            continue
        match = d.match if isinstance(d, Rule) else None  # the default plan matches every request
        named = match.provider if match is not None else None
        named = [named] if isinstance(named, str) else named
        if named is not None and not sglang_providers & set(named):
            continue  # the rule only fires for providers this file has not, or that are no SGLang
        targets = [p for p in pools if p.name == d.pool and (named is None or p.provider in named)]
        if not targets:
            known = ", ".join(sorted({p.name for p in pools}))
            problems.append(
                policy_loc.problem(
                    (*path, "pool"),
                    f"unknown pool {d.pool!r}: no SGLang or vLLM provider in {routing_loc.source} has it "
                    f"(pools there: {known})",
                )
            )
            continue
        for target in targets:
            named_pools.add((target.provider, target.name))
            problems += _routed_problems(d, path, match, target, policy_loc)
    for target in pools:
        launch = target.pool.launch
        cfg = routing.providers[target.provider]  # a pool provider's: deployed_pools lists no other
        is_default = isinstance(cfg, PoolConfigBase) and cfg.default_pool == target.name
        if is_default and not launch.tool_call_parser:
            at = ("providers", target.provider, "default_pool")
            if at not in routing_loc.values:
                at = target.path
            problems.append(
                routing_loc.problem(
                    at,
                    f"pool {target.name!r} is provider {target.provider!r}'s default_pool, so it serves "
                    f"tool_call turns, but has no launch.tool_call_parser: {target.engine} returns tool "
                    "calls as text unless launched with --tool-call-parser",
                )
            )
        problems += head_problems(target, routing_loc, head_notes)
        if (target.provider, target.name) not in named_pools:
            continue  # no rule of this policy routes there: its flags come from the launch alone
        try:
            _compile(target, policy)
        except ValueError as exc:
            problems.append(routing_loc.problem((*target.path, "launch"), str(exc)))
    return problems


def _routed_problems(d, path: tuple, match, target: DeployedPool, loc: Located) -> list[Problem]:
    """What the pool a rule (or the default) names must offer the turns and batch sizes it sends."""
    launch = target.pool.launch
    name = target.name
    if isinstance(launch, VLLMLaunch):
        serves, algorithm = VLLM_SERVES[launch.method], f"vLLM {launch.method}"
    else:
        serves, algorithm = SERVES[launch.algorithm], launch.algorithm
    if d.method not in serves:
        return [loc.problem((*path, "method"), f"method {d.method} cannot be served by pool {name!r} ({algorithm})")]
    problems = []
    turns = match.turn_type if match is not None else None
    serves_tools = turns is None or "tool_call" in ([turns] if isinstance(turns, str) else turns)
    if serves_tools and not launch.tool_call_parser:
        problems.append(
            loc.problem(
                (*path, "pool"),
                f"pool {name!r} serves tool_call turns but has no tool_call_parser: {target.engine} returns "
                "tool calls as text unless launched with --tool-call-parser",
            )
        )
    if isinstance(launch, VLLMLaunch):
        return problems + _vllm_batch_problems(path, match, target.name, launch, loc)
    limit = launch.max_running_requests
    if launch.adaptive and limit is not None and match is not None:
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


def _vllm_batch_problems(path: tuple, match, name: str, launch: VLLMLaunch, loc: Located) -> list[Problem]:
    """A vLLM pool runs at most max_num_seqs requests: a rule's range past it never fires there."""
    limit = launch.max_num_seqs
    b = match.batch_size if match is not None else None
    if limit is None or b is None:
        return []
    for field, value in (("min", b.min), ("max", b.max)):
        if value is not None and value > limit:
            at = (*path, "match", "batch_size", field)
            if at not in loc.values:
                at = (*path, "match", "batch_size")
            return [
                loc.problem(
                    at,
                    f"batch_size {field} {value} is past vLLM pool {name!r}'s max_num_seqs {limit} "
                    "(its running batch never passes it): bound the range at or below it",
                )
            ]
    return []


def _head_of(deployed: DeployedPool) -> tuple[str, str, str] | None:
    """(launch key, head path, served model) of an EAGLE pool; None for any other."""
    launch = deployed.pool.launch
    if isinstance(launch, VLLMLaunch):
        if launch.method not in ("eagle", "eagle3") or not launch.draft_model:
            return None
        model = launch.model_path or deployed.model
        return "draft_model", launch.draft_model, DEFAULT_MODEL_NAME if model == EMBEDDED_MODEL else model
    if not launch.eagle or not launch.draft_model_path:
        return None
    return "draft_model_path", launch.draft_model_path, deployed.model


def head_problems(deployed: DeployedPool, loc: Located, notes: list[Problem]) -> list[Problem]:
    """An EAGLE pool's head held against the model the pool serves, at the head's line."""
    found = _head_of(deployed)
    if found is None:
        return []
    key, head_path, model = found
    folder = Path(head_path)  # as the engine opens it: no ~ expansion in its flags
    if not folder.is_dir():
        return []  # a hub id or a path on the serving host: the engine resolves it
    at = (*deployed.path, "launch", key)
    say = f"pool {deployed.name!r}: {key} {head_path}"
    try:
        head = read_head_target(folder)
        shape = model_shape(model)
    except ValueError as exc:
        return [loc.problem(at, f"{say}: {exc}")]
    if head.layout == "eagle":
        return [loc.problem(at, f"{say} is the runner's own eagle layout, which {deployed.engine} does not "
                                "load: train it with `draft train --layout eagle3`")]
    if head.fingerprint is not None:
        wrong = _fingerprint_mismatch(head.fingerprint, shape)
    else:
        wrong = _size_mismatch(head, shape)
        if wrong is None:
            checked = (f"checked against {model!r} on hidden and vocabulary sizes only" if shape.config is not None
                       else f"not checked ({model!r} is no local model folder whose sizes could be read)")
            notes.append(loc.problem(at, f"note: {say} has no {OWN_KEY} target fingerprint (a head trained "
                                         f"elsewhere): {checked}"))
    if wrong is None:
        return []
    return [loc.problem(at, f"{say} was trained for another target than {model!r}, the model the pool "
                            f"serves: {wrong}")]


def _fingerprint_mismatch(fp: dict, shape: ModelShape) -> str | None:
    if fp.get("name") not in shape.names:
        return (f"its config.json's {OWN_KEY}.target.name is {fp.get('name')!r}, the pool's model "
                f"is {' or '.join(repr(n) for n in shape.names)}")
    for key, mine, theirs in (("hidden", "hidden_size", shape.hidden), ("vocab_size", "vocab_size", shape.vocab_size),
                              ("n_layers", "num_hidden_layers", shape.n_layers)):
        if theirs is not None and fp.get(key) != theirs:
            return (f"its config.json's {OWN_KEY}.target.{key} is {fp.get(key)!r}, {mine} is {theirs} "
                    f"in {shape.config}")
    return None


def _size_mismatch(head: HeadTarget, shape: ModelShape) -> str | None:
    for key, mine, theirs in (("hidden_size", head.hidden, shape.hidden),
                              ("vocab_size", head.vocab_size, shape.vocab_size)):
        if theirs is not None and mine != theirs:
            return (f"its config.json's {key} is {mine!r}, {theirs} in {shape.config} (a head from elsewhere, "
                    f"with no {OWN_KEY} fingerprint: checked on hidden and vocabulary sizes only)")
    return None


def _read(path: str | Path, error: type[ConfigError]) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise error([Problem(str(path), 1, 1, f"cannot read: {exc.strerror or exc}")]) from None
