"""YAML to plain Python data, remembering where every key and value sits in the file.

PyYAML's composer keeps a mark (line, column) on every node; we construct the data ourselves
from the node tree so that each path like ("rules", 2, "gamma") maps back to its position.
Duplicate keys, which PyYAML silently lets the last one win, are reported as problems.

Bounded: a file is parsed only within LIMITS (its size, nesting depth, number of aliases, and the
values the aliases expand to), so a few hundred bytes of anchors ("billion laughs") or an alias
inside the node it names are a problem at the alias's FILE:LINE:COL, not gigabytes and a pegged CPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from openalice_runner.config_files.errors import ConfigError, Problem

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class YamlLimits:
    """What an operator file may cost to read. Real policy and providers files are a few KiB with
    a handful of aliases; these are far above that and far below what hurts a server."""

    max_bytes: int = 1 << 20
    max_depth: int = 64  # nested mappings and sequences
    max_aliases: int = 1_000
    max_values: int = 100_000  # every value once per place it appears, aliases expanded


LIMITS = YamlLimits()


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

    def data_path(self, err_loc: tuple) -> Path:
        """pydantic's error loc as far as it names keys and indexes in the file (union branch tags
        such as 'sglang' dropped)."""
        path: Path = ()
        for part in err_loc:
            candidate = (*path, part)
            if candidate in self.values or candidate in self.keys:
                path = candidate
        return path


MERGE_TAG = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans: only true/false, so `method: off` stays the string "off";
    its composer counts aliases and depth and refuses an alias inside the node it names."""

    limits = LIMITS

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.alias_uses: list[tuple[yaml.Node, yaml.Mark, str]] = []  # (target, where, name)
        self._open_anchors: set[str] = set()
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            if event.anchor in self._open_anchors:
                raise yaml.composer.ComposerError(
                    None, None, f"alias *{event.anchor} is inside the node &{event.anchor} it names "
                    "(a recursive alias)", event.start_mark)  # fmt: skip
            if len(self.alias_uses) >= self.limits.max_aliases:
                raise yaml.composer.ComposerError(
                    None, None, f"more than {self.limits.max_aliases} aliases", event.start_mark
                )
            node = super().compose_node(parent, index)  # raises where the anchor is undefined
            self.alias_uses.append((self.anchors[event.anchor], event.start_mark, event.anchor))
            return node
        return super().compose_node(parent, index)

    def _nested(self, compose: Any, anchor: str | None) -> Any:
        self._depth += 1
        if self._depth > self.limits.max_depth:
            raise yaml.composer.ComposerError(
                None, None, f"nested more than {self.limits.max_depth} deep", self.peek_event().start_mark
            )
        if anchor is not None:
            self._open_anchors.add(anchor)
        try:
            return compose(anchor)
        finally:
            self._open_anchors.discard(anchor)
            self._depth -= 1

    # types-PyYAML has `anchor` a dict; PyYAML passes the anchor's name (Composer.compose_node)
    def compose_sequence_node(self, anchor: str | None) -> Any:  # type: ignore[override]
        return self._nested(super().compose_sequence_node, anchor)

    def compose_mapping_node(self, anchor: str | None) -> Any:  # type: ignore[override]
        return self._nested(super().compose_mapping_node, anchor)


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
    limit = LIMITS.max_bytes
    if len(text) > limit:  # characters; a byte cap is the caller's (the file's size)
        raise error([Problem(source, 1, 1, f"file is larger than {limit} bytes; the limit is {limit}")])
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
        too_big = _expansion_problem(root, loader, source)
        if too_big is not None:
            raise error([too_big])
        problems: list[Problem] = []
        located.data = _build(root, (), loader, located, problems)
        if problems:
            raise error(problems)
        return located
    finally:
        loader.dispose()


def _expansion_problem(root: yaml.Node, loader: _Loader, source: str) -> Problem | None:
    """The alias that makes the file too large once expanded (the largest one), or None.

    Sizes are counted over the node graph, each distinct node once (memoised), so counting a
    bomb costs what its few hundred bytes hold, not what it would expand to."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        known = sizes.get(id(node))
        if known is not None:
            return known
        if isinstance(node, yaml.MappingNode):
            total = 1 + sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(item) for item in node.value)
        else:
            total = 1
        sizes[id(node)] = total
        return total

    limit = LIMITS.max_values
    total = size(root)
    if total <= limit:
        return None
    target, mark, name = max(loader.alias_uses, key=lambda use: size(use[0]), default=(root, root.start_mark, ""))
    what = f"alias *{name} repeats {size(target)} values" if name else "the file holds"
    return Problem(source, mark.line + 1, mark.column + 1,
                   f"{what}; expanded, the file would hold {total} values, more than the limit of {limit}")  # fmt: skip


def _build(node: yaml.Node, path: Path, loader: _Loader, loc: Located, problems: list[Problem]) -> Any:
    if isinstance(node, yaml.MappingNode):
        return _build_mapping(node, path, loader, loc, problems)
    loc.values[path] = _pos(node)
    if isinstance(node, yaml.SequenceNode):
        return [_build(item, (*path, i), loader, loc, problems) for i, item in enumerate(node.value)]
    try:
        return loader.construct_object(node)
    except yaml.YAMLError as exc:
        line, col = _pos(node)
        problems.append(Problem(loc.source, line, col, f"bad scalar: {exc}"))
        return None


def _build_mapping(
    node: yaml.MappingNode, path: Path, loader: _Loader, loc: Located, problems: list[Problem]
) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    # merged keys first, so the mapping's own keys below overwrite them
    for key_node, value_node in node.value:
        if key_node.tag == MERGE_TAG:
            _merge_into(out, key_node, value_node, path, loader, loc, problems)
    loc.values[path] = _pos(node)  # after the merges, which record the merged mappings at `path`
    own: set[str] = set()
    for key_node, value_node in node.value:
        if key_node.tag == MERGE_TAG:
            continue
        if not isinstance(key_node, yaml.ScalarNode):
            line, col = _pos(key_node)
            problems.append(Problem(loc.source, line, col, "mapping keys must be plain scalars"))
            continue
        key = loader.construct_object(key_node)
        if not isinstance(key, str):
            key = str(key)  # `1: x` keys; the schema decides whether they are allowed
        if key in own:
            line, col = _pos(key_node)
            problems.append(Problem(loc.source, line, col, f"duplicate key {key!r}"))
            continue
        own.add(key)
        loc.keys[(*path, key)] = _pos(key_node)
        out[key] = _build(value_node, (*path, key), loader, loc, problems)
    return out


def _merge_into(
    out: dict[Any, Any], key_node: yaml.Node, value_node: yaml.Node,
    path: Path, loader: _Loader, loc: Located, problems: list[Problem],
) -> None:  # fmt: skip
    """`<<: *anchor` (or a list of them): the anchored mappings' keys go in first, as YAML's merge
    key says (a pool's launch sharing another's settings); the first mapping listed wins."""
    for source in value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]:
        if not isinstance(source, yaml.MappingNode):
            line, col = _pos(key_node)  # an alias's node sits at its anchor
            problems.append(Problem(loc.source, line, col, "<< (merge key) takes a mapping or a list of them"))
            continue
        for key, value in _build(source, path, loader, loc, problems).items():
            out.setdefault(key, value)
