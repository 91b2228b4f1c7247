"""Load a policy file: YAML with positions -> pydantic schema -> cross-field checks -> rule analysis.

Every problem comes back as FILE:LINE:COL inside one PolicyError; nothing half-valid is returned.
"""

from __future__ import annotations

import difflib
import hashlib
import types
import typing
from dataclasses import dataclass
from pathlib import Path as FsPath

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from openalice_runner.config_files.errors import Problem
from openalice_runner.config_files.reading import read_operator_file
from openalice_runner.config_files.yaml_nodes import Located, Path, load_located
from openalice_runner.policies.analysis import analyse_rules
from openalice_runner.policies.checks import check_policy
from openalice_runner.policies.errors import PolicyError
from openalice_runner.policies.schema import Policy


@dataclass(frozen=True)
class LoadedPolicy:
    policy: Policy
    version: str  # content hash of the file's bytes
    source: str


def content_version(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


def load_policy_file(path: str | FsPath) -> LoadedPolicy:
    path = FsPath(path)
    try:
        data = read_operator_file(path)  # a regular file within the loader's limit (config_files/reading.py)
    except OSError as exc:
        raise PolicyError([Problem(str(path), 1, 1, f"cannot read policy file: {exc}")]) from None
    return load_policy_bytes(data, str(path))


def load_policy_bytes(data: bytes, source: str = "<policy>") -> LoadedPolicy:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError([Problem(source, 1, 1, f"not UTF-8: {exc}")]) from None
    return LoadedPolicy(parse_policy(text, source), content_version(data), source)


def load_policy_text(text: str, source: str = "<policy>") -> LoadedPolicy:
    return load_policy_bytes(text.encode("utf-8"), source)


def parse_policy(text: str, source: str) -> Policy:
    loc = load_located(text, source, empty="a policy needs at least `default:`", error=PolicyError)
    if not isinstance(loc.data, dict):
        raise PolicyError([loc.problem((), "a policy file must be a mapping with at least `default:`")])
    moved = _moved_keys(loc)
    data = {k: v for k, v in loc.data.items() if k not in MOVED_TO_ROUTING}
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(moved + _schema_problems(exc, loc)) from None
    problems = moved + check_policy(policy, loc)
    problems += analyse_rules(policy.rules, loc)
    if problems:
        raise PolicyError(problems)
    return policy


# Keys older policy files had, and where their content lives now.
MOVED_TO_ROUTING = {
    "pools": "`pools:` moved to the routing file: each pool's replicas and launch settings sit under "
    "providers.NAME.pools.POOL (type: sglang; docs/sglang.md), and a rule names its pool with `pool:`",
}


def _moved_keys(loc: Located) -> list[Problem]:
    return [loc.problem((key,), message, key=True) for key, message in MOVED_TO_ROUTING.items() if key in loc.data]


# ---- pydantic errors -> positioned problems ---------------------------------------------------


def _schema_problems(exc: ValidationError, loc: Located) -> list[Problem]:
    # One field of a union type (e.g. gamma: int | "auto") yields one error per branch: merge them.
    grouped: dict[tuple[Path, bool], list[ErrorDetails]] = {}
    for err in exc.errors(include_url=False):
        path = loc.data_path(err["loc"])
        grouped.setdefault((path, err["type"] == "extra_forbidden"), []).append(err)
    problems = []
    for (path, is_key), errs in grouped.items():
        problems.append(loc.problem(path, _message(path, errs), key=is_key))
    return problems


def _dotted(path: Path) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def _message(path: Path, errs: list[ErrorDetails]) -> str:
    first = errs[0]
    kind = first["type"]
    if kind == "extra_forbidden":
        key = path[-1]
        allowed = _allowed_keys(path[:-1])
        hint = ""
        if allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (allowed: {', '.join(allowed)})"
        return f"unknown key {key!r} in {_dotted(path[:-1])}{hint}"
    if kind == "missing":
        missing = [e["loc"][-1] for e in errs]
        return f"{_dotted(path)}: missing required key {', '.join(repr(m) for m in missing)}"
    msgs = list(dict.fromkeys(e["msg"][0].lower() + e["msg"][1:] for e in errs))
    got = first.get("input")
    shown = repr(got) if not isinstance(got, dict | list) else type(got).__name__
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{_dotted(path)}: {' or '.join(msgs)}, got {shown}"


def _allowed_keys(path: Path) -> list[str]:
    """Field names of the schema model found at `path`, for "did you mean" hints."""
    ann: typing.Any = Policy
    for part in path:
        ann = _step(ann, part)
        if ann is None:
            return []
    for m in _members(ann):
        if isinstance(m, type) and issubclass(m, BaseModel):
            return list(m.model_fields)
    return []


def _members(ann: typing.Any) -> tuple:
    return typing.get_args(ann) if typing.get_origin(ann) in (typing.Union, types.UnionType) else (ann,)


def _step(ann: typing.Any, part: str | int) -> typing.Any:
    for m in _members(ann):
        origin = typing.get_origin(m)
        if isinstance(part, int) and origin is list:
            return typing.get_args(m)[0]
        if isinstance(part, str):
            if isinstance(m, type) and issubclass(m, BaseModel) and part in m.model_fields:
                return m.model_fields[part].annotation
            if origin is dict:
                return typing.get_args(m)[1]
    return None
