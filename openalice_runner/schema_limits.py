"""What a request's JSON Schema (tools[].function.parameters, response_format.json_schema.schema)
may cost, checked before anything recursive reads it.

jsonschema's meta-schema check, our schema rewrites and the grammar compiler all recurse over a
schema: a few KB nested 100 deep was a RecursionError (500) and 300 KB of traceback per request.
The walk here is iterative. OpenAI itself allows 10 levels of nesting and 5,000 properties in a
structured-output schema; these limits are well above that.

`$ref`s are bounded too (`check_refs`): the grammar compiler follows them recursively in native
code, and a chain of 1,000 definitions, each an object whose one property refers to the next,
crashed the server (SIGSEGV) though it is only 64 levels deep as JSON.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote


@dataclass(frozen=True)
class SchemaLimits:
    max_depth: int = 64  # nested JSON objects and arrays
    max_nodes: int = 50_000  # JSON values in all
    max_refs: int = 1_000  # `$ref` keywords in all
    max_alias_chain: int = 32  # `$ref`s in a row to schemas that are themselves only a `$ref`
    # JSON levels and `$ref` hops along any path from the root, `$ref`s followed; a cycle of `$ref`s
    # counts every object and array on it once (a path through it need not take the whole cycle)
    max_resolved_depth: int = 512


LIMITS = SchemaLimits()


@dataclass
class CompileLimits:
    """How long a request's grammar may take to compile before it is refused (400, never remembered
    as the schema's fault), counted from when a compile worker has it; `serve --grammar-timeout`
    sets it for the process (engine/grammar.py reads it at each compile). Compiles wait for one of
    the workers at most `queue_timeout_s`, and at most `max_queued` wait: past either, 429."""

    timeout_s: float = 10.0
    queue_timeout_s: float = 30.0
    max_queued: int = 32


COMPILE = CompileLimits()


def check_schema_limits(schema: Any, limits: SchemaLimits = LIMITS) -> None:
    """ValueError naming the limit `schema` passes (depth or size); nothing recursive runs here."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    nodes = 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > limits.max_nodes:
            raise ValueError(f"the schema has more than {limits.max_nodes} JSON values (the limit)")
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limits.max_depth:
            raise ValueError(f"the schema is nested more than {limits.max_depth} levels deep (the limit)")
        stack.extend((child, depth + 1) for child in children)


# A schema that is only a `$ref` (and words about it) is an alias of its target.
_ALIAS_KEYS = frozenset({"$ref", "$defs", "definitions", "$schema", "$comment", "title", "description", "default",
                         "examples", "deprecated", "readOnly", "writeOnly"})  # fmt: skip


def check_refs(schema: Any, limits: SchemaLimits = LIMITS) -> None:
    """ValueError naming the limit `schema`'s `$ref`s pass: how many there are, chains of aliases
    (a cycle of them never reaches a value), and the depth with every `$ref` followed. Local refs
    only (`#`, `#/pointer`, `#anchor`): others do not resolve here, and the grammar compiler
    refuses them itself. Iterative; run after check_schema_limits (the size is bounded)."""
    nodes, edges, refs, anchors = _index(schema)
    if len(refs) > limits.max_refs:
        raise ValueError(f"the schema has more than {limits.max_refs} $refs (the limit)")
    if not refs:
        return
    index = {id(node): i for i, node in enumerate(nodes)}
    targets: dict[int, int] = {}
    for i, ref in refs:
        target = _resolve(schema, ref, anchors, index)
        if target is not None:
            targets[i] = target
            edges[i].append(target)
    _check_aliases(nodes, targets, limits)
    if _resolved_depth(edges) + 1 > limits.max_resolved_depth:
        raise ValueError(f"the schema nests more than {limits.max_resolved_depth} levels deep where its $refs are "
                         "followed (the limit)")


def _index(schema: Any) -> tuple[list[Any], list[list[int]], list[tuple[int, str]], dict[str, int]]:
    """The schema's objects and arrays (the root first), each one's children (their indices), the
    `$ref`s (the index of the object holding each) and the `$anchor`s."""
    nodes: list[Any] = []
    edges: list[list[int]] = []
    refs: list[tuple[int, str]] = []
    anchors: dict[str, int] = {}
    if not isinstance(schema, (dict, list)):
        return nodes, edges, refs, anchors
    stack: list[tuple[Any, int]] = [(schema, -1)]
    while stack:
        value, parent = stack.pop()
        i = len(nodes)
        nodes.append(value)
        edges.append([])
        if parent >= 0:
            edges[parent].append(i)
        if isinstance(value, dict):
            if isinstance(value.get("$ref"), str):
                refs.append((i, value["$ref"]))
            if isinstance(value.get("$anchor"), str):
                anchors.setdefault(value["$anchor"], i)
            children: Any = value.values()
        else:
            children = value
        stack.extend((child, i) for child in children if isinstance(child, (dict, list)))
    return nodes, edges, refs, anchors


def _resolve(schema: Any, ref: str, anchors: dict[str, int], index: dict[int, int]) -> int | None:
    if not ref.startswith("#"):
        return None
    fragment = unquote(ref[1:])
    if not fragment.startswith("/"):
        return anchors.get(fragment) if fragment else 0
    value = schema
    for token in fragment[1:].split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict) and token in value:
            value = value[token]
        elif isinstance(value, list) and token.isdigit() and int(token) < len(value):
            value = value[int(token)]
        else:
            return None
    return index.get(id(value))


def _check_aliases(nodes: list[Any], targets: dict[int, int], limits: SchemaLimits) -> None:
    aliases = {i: t for i, t in targets.items() if isinstance(nodes[i], dict) and nodes[i].keys() <= _ALIAS_KEYS}
    length: dict[int, int] = {}  # aliases in a row from each alias
    for start in aliases:
        path: list[int] = []
        on_path: set[int] = set()
        node = start
        while node in aliases and node not in length:
            if node in on_path:
                raise ValueError("no JSON value satisfies the schema: its $refs form a cycle of aliases, "
                                 "each only a $ref to the next")
            on_path.add(node)
            path.append(node)
            node = aliases[node]
        known = length.get(node, 0)
        for n, alias in enumerate(reversed(path), start=1):
            length[alias] = known + n
        if length[start] > limits.max_alias_chain:
            raise ValueError(f"the schema has a chain of more than {limits.max_alias_chain} $refs, each to a "
                             "schema that is only a $ref (the limit)")


def _resolved_depth(edges: list[list[int]]) -> int:
    """An upper bound on the longest path from the root (node 0) that passes no node twice, in
    edges: Tarjan's strongly connected components (iterative), each counted at its size, on the
    longest chain of them."""
    n = len(edges)
    order, low, component = [-1] * n, [0] * n, [-1] * n
    on_stack = [False] * n
    stack: list[int] = []
    bound: list[int] = []  # per component, in the order they complete (successors first)
    order[0] = low[0] = 0
    counter = 1
    stack.append(0)
    on_stack[0] = True
    work = [(0, 0)]
    while work:
        v, i = work[-1]
        if i < len(edges[v]):
            work[-1] = (v, i + 1)
            w = edges[v][i]
            if order[w] < 0:
                order[w] = low[w] = counter
                counter += 1
                stack.append(w)
                on_stack[w] = True
                work.append((w, 0))
            elif on_stack[w]:
                low[v] = min(low[v], order[w])
            continue
        work.pop()
        if work:
            parent = work[-1][0]
            low[parent] = min(low[parent], low[v])
        if low[v] != order[v]:
            continue
        members = []
        c = len(bound)
        while True:
            w = stack.pop()
            on_stack[w] = False
            component[w] = c
            members.append(w)
            if w == v:
                break
        out = max((1 + bound[component[w]] for m in members for w in edges[m] if component[w] != c), default=0)
        bound.append(len(members) - 1 + out)
    return bound[component[0]]


# ---- schemas already checked: the meta-schema check's result, by the schema's canonical JSON

_VALID: OrderedDict[bytes, None] = OrderedDict()
_VALID_MAX = 4096
_VALID_LOCK = threading.Lock()  # requests are parsed in worker threads


def known_valid(schema: Any) -> bytes | None:
    """None where `schema` (its canonical JSON, by SHA-256) passed the meta-schema check before;
    else the digest to hand to `remember_valid` once it passes. A schema that is not plain JSON
    gets a digest no check remembers, so it is checked every time."""
    try:
        canonical = json.dumps(schema, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        return b""
    digest = hashlib.sha256(canonical.encode()).digest()
    with _VALID_LOCK:
        if digest in _VALID:
            _VALID.move_to_end(digest)
            return None
    return digest


def remember_valid(digest: bytes) -> None:
    if not digest:
        return
    with _VALID_LOCK:
        _VALID[digest] = None
        if len(_VALID) > _VALID_MAX:
            _VALID.popitem(last=False)
