"""Routing config (operator YAML under providers/): the providers, and routes naming fallback chains.

    providers:
      local: {type: local}
      gpu:   {type: sglang, model: ..., pools: {eagle3: {...}, ngram: {...}}}
      cpu:   {type: vllm, model: ..., pools: {ngram: {...}, plain: {...}}}
      cloud: {type: hosted, model: openai/gpt-4o-mini, api_key_env: OPENAI_API_KEY}
    routes:                      # first match wins
      - name: tools
        match: {turn_types: [tool_call, code_edit], models: [...]}   # both optional
        chain: [gpu, cloud]      # fallback order
      - name: default
        match: {models: ["*"]}   # "*": any model name (without it, only the names the chain serves)
        chain: [local]

A request's model name matches a route that lists it, a route whose `models` holds "*", or a route
without `models` whose chain serves that name; a request without a model matches a route without
`models` or with "*". A name no route takes is refused (UnknownModelError: 404 model_not_found).

Validated like the policy: every problem is reported as FILE:LINE:COL (positions from the shared
YAML loader, openalice_runner/config_files/yaml_nodes.py).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated

from pydantic import Field, ValidationError, model_validator

from openalice_runner.config_files import ConfigError, Located, Problem, StrictModel, load_located
from openalice_runner.config_files.reading import read_operator_file
from openalice_runner.providers.embedded.config import EmbeddedConfig
from openalice_runner.providers.hosted import HostedConfig
from openalice_runner.providers.pools.sglang.launch import launch_problems
from openalice_runner.providers.pools.sglang.provider import SGLangConfig
from openalice_runner.providers.pools.vllm.launch import launch_problems as vllm_launch_problems
from openalice_runner.providers.pools.vllm.provider import VLLMConfig

ProviderConfig = Annotated[
    EmbeddedConfig | SGLangConfig | VLLMConfig | HostedConfig, Field(discriminator="type")
]


CATCH_ALL_MODEL = "*"


class UnknownModelError(LookupError):
    """A request names a model no route serves (the sidecar answers 404 model_not_found)."""


class RouteMatch(StrictModel):
    turn_types: list[str] | None = None  # None: any turn type
    # Requested model names ("*": any). None: requests without a model, or naming one the chain serves.
    models: list[str] | None = None


class Route(StrictModel):
    name: str
    match: RouteMatch = Field(default_factory=RouteMatch)
    chain: list[str] = Field(min_length=1)

    def matches(self, turn_type: str, model: str | None, served: Sequence[str] | None = None) -> bool:
        """`served`: the model names this route's chain serves (None: not known, so any name)."""
        m = self.match
        if m.turn_types is not None and turn_type not in m.turn_types:
            return False
        if m.models is not None:
            return model in m.models or CATCH_ALL_MODEL in m.models
        return model is None or served is None or model in served


class RoutingConfig(StrictModel):
    providers: dict[str, ProviderConfig] = Field(min_length=1)
    routes: list[Route] = Field(min_length=1)

    @model_validator(mode="after")
    def _chains_name_providers(self) -> RoutingConfig:
        names = set()
        for i, route in enumerate(self.routes):
            if route.name in names:
                raise _AtPath(("routes", i, "name"), f"duplicate route name {route.name!r}")
            names.add(route.name)
            for j, provider in enumerate(route.chain):
                if provider not in self.providers:
                    raise _AtPath(
                        ("routes", i, "chain", j),
                        f"route {route.name!r} names provider {provider!r}, which is not in providers "
                        f"({', '.join(self.providers)})",
                    )
            if len(set(route.chain)) != len(route.chain):
                raise _AtPath(("routes", i, "chain"), f"route {route.name!r} lists a provider twice")
        return self

    def route_for(
        self, turn_type: str, model: str | None, served_by: Mapping[str, Sequence[str]] | None = None
    ) -> Route:
        """The first route that takes the request. `served_by`: provider name -> model names it serves."""
        for route in self.routes:
            served = None if served_by is None else [n for p in route.chain for n in served_by.get(p, ())]
            if route.matches(turn_type, model, served):
                return route
        if model is not None and any(r.matches(turn_type, None) for r in self.routes):
            raise UnknownModelError(
                f"model {model!r} is not served here (GET /v1/models lists the models; a route with "
                f"`models: [\"*\"]` takes any name)"
            )
        raise LookupError(
            f"no route matches turn_type={turn_type!r}, model={model!r}; add a catch-all route (no `match`)"
        )

    @classmethod
    def default(cls) -> RoutingConfig:
        """The routing file shipped in the package (a copy of providers/default.yaml): the embedded default model."""
        from openalice_runner import defaults

        return load_routing_text(defaults.text(defaults.PROVIDERS), "openalice_runner/defaults/providers.yaml")


class RoutingConfigError(ConfigError):
    """A routing file that cannot be used; `problems` lists each as FILE:LINE:COL: message."""

    empty_message = "invalid routing file"


class _AtPath(ValueError):
    """A cross-field problem that knows where in the file it belongs."""

    def __init__(self, path: tuple, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message


def load_routing_file(path: str | Path) -> RoutingConfig:
    path = Path(path)
    try:
        text = read_operator_file(path).decode("utf-8")  # a regular file within the loader's limit
    except OSError as exc:
        raise RoutingConfigError([Problem(str(path), 1, 1, f"cannot read: {exc}")]) from None
    except UnicodeDecodeError as exc:
        raise RoutingConfigError([Problem(str(path), 1, 1, f"not UTF-8 text ({exc.reason} at byte {exc.start})")]) from None
    return load_routing_text(text, str(path))


def load_routing_text(text: str, source: str = "<providers>") -> RoutingConfig:
    loc = load_located(
        text, source, empty="a routing file needs `providers:` and `routes:`", error=RoutingConfigError
    )
    if not isinstance(loc.data, dict):
        raise RoutingConfigError(
            [loc.problem((), "a routing file must be a mapping with `providers:` and `routes:`")]
        )
    try:
        config = RoutingConfig.model_validate(loc.data)
    except ValidationError as exc:
        raise RoutingConfigError(_problems(exc, loc)) from None
    _check_pool_launch(config, loc)
    _check_engine_extra(config, loc)
    return config


def _check_pool_launch(config: RoutingConfig, loc: Located) -> None:
    """Each SGLang or vLLM pool's launch settings, checked where they sit (they become its
    servers' flags)."""
    problems = []
    for name, provider in config.providers.items():
        if isinstance(provider, SGLangConfig):
            found = [(pool_name, launch_problems(pool.launch)) for pool_name, pool in provider.pools.items()]
        elif isinstance(provider, VLLMConfig):
            found = [(pool_name, vllm_launch_problems(pool.launch)) for pool_name, pool in provider.pools.items()]
        else:
            continue
        for pool_name, pool_problems in found:
            at = ("providers", name, "pools", pool_name, "launch")
            for sub, message, key in pool_problems:
                problems.append(loc.problem((*at, *sub), f"pool {pool_name!r}: {message}", key=key))
    if problems:
        raise RoutingConfigError(problems)


def _check_engine_extra(config: RoutingConfig, loc: Located) -> None:
    """A `local` provider runs the embedded engine: without torch say so at load, not at the first request."""
    if importlib.util.find_spec("torch") is not None:  # find, never import: this module stays torch-free
        return
    problems = [
        loc.problem(
            ("providers", name, "type"),
            f"provider {name!r} needs the engine extra: pip install 'openalice-runner[engine]'",
        )
        for name, provider in config.providers.items()
        if provider.type == "local"
    ]
    if problems:
        raise RoutingConfigError(problems)


def _problems(exc: ValidationError, loc: Located) -> list[Problem]:
    problems = []
    for err in exc.errors(include_url=False):
        ctx_error = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_error, _AtPath):
            problems.append(loc.problem(ctx_error.path, ctx_error.message))
            continue
        path = loc.data_path(err["loc"])
        where = _label(err["loc"])
        if err["type"] == "extra_forbidden":
            problems.append(loc.problem(path, f"unknown key {err['loc'][-1]!r} at {where}", key=True))
        elif err["type"] == "missing":
            problems.append(loc.problem(path, f"{where}: missing required key"))
        else:
            problems.append(loc.problem(path, f"{where}: {err['msg']}"))
    # One error per union branch can repeat a message: keep each once.
    return list(dict.fromkeys(problems))


def _label(err_loc: tuple) -> str:
    """Dotted field path as the operator wrote it (the provider-type union tag dropped)."""
    parts = [
        str(p)
        for i, p in enumerate(err_loc)
        if not (i == 2 and err_loc[0] == "providers" and p in ("local", "sglang", "vllm", "hosted"))
    ]
    return ".".join(parts) or "(top level)"

