"""YAML to plain Python data, remembering where every key and value sits in the file.

PyYAML's composer keeps a mark (line, column) on every node; we construct the data ourselves
from the node tree so that each path like ("rules", 2, "gamma") maps back to its position.
Duplicate keys, which PyYAML silently lets the last one win, are reported as problems.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from openalice_runner.config_files.errors import ConfigError, Problem

Path = tuple[str | int, ...]


@dataclass
class Located:
    """Parsed data plus the 1-based (line, column) of each value and each mapping key."""

    data: Any
    source: str
    values: dict[Path, tuple[int, int]] = field(default_factory=dict)
    keys: dict[Path, tuple[int, int]] = field(default_factory=dict)

    def where(self, path: Path, *, key: bool = False) -> tuple[int, int]:
        """Position of `path`, or of its nearest ancestor that exists in the file."""
        table = self.keys if key else self.values
        for cut in range(len(path), -1, -1):
            prefix = tuple(path[:cut])
            if prefix in table:
                return table[prefix]
            if prefix in self.values:
                return self.values[prefix]
        return (1, 1)

    def problem(self, path: Path, message: str, *, key: bool = False) -> Problem:
        line, col = self.where(path, key=key)
        return Problem(self.source, line, col, message)


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans: only true/false, so `method: off` stays the string "off"."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _pos(node: yaml.Node) -> tuple[int, int]:
    return (node.start_mark.line + 1, node.start_mark.column + 1)


def load_located(
    text: str, source: str, *, empty: str, error: type[ConfigError] = ConfigError
) -> Located:
    """Parse YAML text; raise `error` (with positions) on syntax errors, duplicate keys or an empty file.

    `empty` says what the file needs, for the empty-file problem; `error` is the caller's ConfigError
    subclass (PolicyError, RoutingConfigError), so its callers catch the one they expect.
    """
    try:
        loader = _Loader(text)
    except yaml.YAMLError as exc:  # the reader rejects control characters up front
        raise error([Problem(source, 1, 1, f"YAML: {exc}")]) from None
    try:
        try:
            root = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
            raise error([Problem(source, line, col, f"YAML syntax: {exc.problem or exc}")]) from None
        except yaml.YAMLError as exc:
            raise error([Problem(source, 1, 1, f"YAML: {exc}")]) from None
        located = Located(data=None, source=source)
        if root is None:
            raise error([Problem(source, 1, 1, f"file is empty: {empty}")])
        problems: list[Problem] = []
        located.data = _build(root, (), loader, located, problems)
        if problems:
            raise error(problems)
        return located
    finally:
        loader.dispose()


def _build(node: yaml.Node, path: Path, loader: _Loader, loc: Located, problems: list[Problem]) -> Any:
    loc.values[path] = _pos(node)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                line, col = _pos(key_node)
                problems.append(Problem(loc.source, line, col, "mapping keys must be plain scalars"))
                continue
            key = loader.construct_object(key_node)
            if not isinstance(key, str):
                key = str(key)  # `1: x` keys; the schema decides whether they are allowed
            if key in out:
                line, col = _pos(key_node)
                problems.append(Problem(loc.source, line, col, f"duplicate key {key!r}"))
                continue
            loc.keys[(*path, key)] = _pos(key_node)
            out[key] = _build(value_node, (*path, key), loader, loc, problems)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_build(item, (*path, i), loader, loc, problems) for i, item in enumerate(node.value)]
    try:
        return loader.construct_object(node)
    except yaml.YAMLError as exc:
        line, col = _pos(node)
        problems.append(Problem(loc.source, line, col, f"bad scalar: {exc}"))
        return None
