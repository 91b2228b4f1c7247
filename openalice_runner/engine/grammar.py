"""Grammar-constrained decoding: which tokens a sequence may emit next (llguidance).

A `Grammar` is compiled once per grammar text and tokenizer (`GrammarCompiler`, cached); each
sequence gets its own `GrammarConstraint`, a matcher that follows the tokens the sequence emits.

The constrained distribution at a position is the target's, masked to the tokens the grammar
allows there and renormalised. Where the grammar forces bytes (JSON punctuation, a key, the
tool's name once chosen), llguidance tokenizes them canonically and the mask allows exactly
that token: a forced token has probability 1, so it can be drafted for free and is always
accepted (`forced`). EOS is allowed exactly where the grammar accepts the text so far.

Why llguidance (not xgrammar) and the measurements: docs/grammar.md.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import queue
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from openalice_runner.engine.closing import closing_candidates
from openalice_runner.engine.grammar_build import (
    GrammarError,
    GrammarFault,
    _short,
    build_matcher,
    llg_tokenizer,
    llguidance,
    tokenizer_json,
)
from openalice_runner.engine.grammar_check import CHECK_STACK, START_TIMEOUT_S, GrammarChecker
from openalice_runner.engine.grammar_constraint import GrammarConstraint, masked_logits, masked_probs
from openalice_runner.engine.types import EngineOverloaded
from openalice_runner.schema_limits import COMPILE

__all__ = ["Grammar", "GrammarCompiler", "GrammarConstraint", "GrammarError", "GrammarFault", "json_grammar",
           "masked_logits", "masked_probs", "tool_call_grammar"]

logger = logging.getLogger(__name__)

TOOL_CALL_OPEN = "<tool_call>"  # the fallback tool format's tags (providers/embedded/tool_format.py)
TOOL_CALL_CLOSE = "</tool_call>"


# ---------------------------------------------------------------- grammar texts (Lark)


# JSON as json.dumps writes it (what the tool format and the model's examples show), no free
# whitespace (a small model fills it with newlines). Not lenient: a keyword llguidance does not
# enforce (`not`, an unknown `format`) is refused with its name, never silently dropped.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}


# Where a schema lets an object hold keys it does not name (no `additionalProperties`), the reply
# names only the declared ones: OpenAI's strict mode and xgrammar's default (SGLang's backend) do
# the same. Every such reply still validates against the schema as given; without it a small model
# copies the schema's own words in as extra keys until max_tokens cuts the call.
_OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
                  "$ref", "if", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """`schema` with every object that names `properties` and says nothing of other keys closed.

    Only narrowing places are walked (properties, items, anyOf branches, definitions), so what
    the closed schema accepts the given one accepts too. Left open: objects that state their own
    rule for other keys, those composed with other schemas (`allOf`, `anyOf`, `$ref`, ...: closing
    one part would forbid the keys another names) or requiring keys they do not name, anything under `not` or `oneOf` (narrowing there can widen the whole),
    and definitions where the schema uses `not` (a definition may be referenced from there)."""
    walk_defs = '"not"' not in json.dumps(schema)
    return _close(schema, walk_defs)


def _close(schema: Any, walk_defs: bool) -> Any:
    if isinstance(schema, list):
        return [_close(s, walk_defs) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if isinstance(value, dict) and (key == "properties" or (walk_defs and key in ("$defs", "definitions"))):
            out[key] = {k: _close(v, walk_defs) for k, v in value.items()}
        elif key in ("items", "prefixItems", "anyOf", "additionalProperties"):
            out[key] = _close(value, walk_defs)
        else:  # allOf, oneOf, not and plain values stay as they are
            out[key] = value
    named = out.get("properties")
    if (isinstance(named, dict) and not any(k in out for k in _OPEN_KEYWORDS)
            and set(out.get("required") or ()) <= set(named)):
        out["additionalProperties"] = False
    return out


def json_rule(name: str, schema: dict[str, Any] | None) -> str:
    """A Lark rule `name` matching one JSON value of `schema` (None: any JSON object)."""
    schema = closed_objects(schema) if schema is not None else {"type": "object"}
    schema["x-guidance"] = {**JSON_OPTIONS, **schema.get("x-guidance", {})}
    return f"{name}: %json {json.dumps(schema)}\n"


def json_grammar(schema: dict[str, Any] | None) -> str:
    """A reply that is one JSON value of `schema` (None: any JSON object)."""
    return "start: value\n" + json_rule("value", schema)


def call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON of one call in the fallback format: {"name": one tool, "arguments": its schema}.

    A tool's local `$ref`s (`#`, `#/$defs/...`: pydantic's usual output) name places in its own
    `parameters`; nested here under `arguments`, they are rewritten to where that is now."""
    options = []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool)
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        at = "/properties/arguments" if len(tools) == 1 else f"/anyOf/{i}/properties/arguments"
        options.append({
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": rebased_refs(params, at)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    return options[0] if len(options) == 1 else {"anyOf": options}


def rebased_refs(schema: Any, at: str) -> Any:
    """`schema` placed at JSON pointer `at` of a larger one: its `$ref`s to JSON pointers within
    itself (`#`, `#/...`) made to point there. The schema as given where it holds none (most
    tools: the grammar text, and with it the compile cache, stays what it was) or where it names
    its own `$id` (its refs then resolve against itself wherever it sits)."""
    if not isinstance(schema, dict) or "$id" in schema or '"$ref"' not in json.dumps(schema):
        return schema
    return _rebase(schema, at)


def _rebase(value: Any, at: str) -> Any:
    if isinstance(value, list):
        return [_rebase(v, at) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: _rebase(v, at) for k, v in value.items()}
    ref = value.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = "#" + at + ref[1:]
    return out


def tool_call_grammar(
    tools: list[dict[str, Any]],
    mode: str,
    parallel: bool = True,
    content_schema: dict[str, Any] | None = None,
    content_json: bool = False,
) -> str:
    """Tool calls in the fallback format (`<tool_call>\\n{json}\\n</tool_call>`, calls one per line).

    mode "required": one call (or several, with `parallel`) and nothing else; "auto": a reply
    without calls (free text, or JSON of `content_schema` where `content_json`), or free text
    followed by calls; "none": free text without calls (the tools are offered, but not now).
    `tools`: the calls allowed (a named tool_choice passes just that one).
    """
    if mode not in ("auto", "required", "none"):
        raise ValueError(f"mode must be 'auto', 'required' or 'none', got {mode!r}")
    if not tools:
        raise GrammarError("tools: a tool grammar needs at least one tool")
    # free text that never holds the open tag (in "auto", the calls' alternative takes it)
    no_call_text = f"TEXT: /(?s:.*)/ & ~/(?s:.*{TOOL_CALL_OPEN}.*)/\n"
    if mode == "none":
        return f"start: TEXT\n{no_call_text}"
    body = json_rule("body", call_schema(tools))
    close = json.dumps("\n" + TOOL_CALL_CLOSE)
    more = f'more: {json.dumps(chr(10) + TOOL_CALL_OPEN + chr(10))} body {close}\n'
    repeat = " more*" if parallel else ""
    if mode == "required":
        return f"start: {json.dumps(TOOL_CALL_OPEN + chr(10))} body {close}{repeat}\n{body}{more}"
    content = json_rule("content", content_schema) if content_json else "content: TEXT\n"
    # the text before a call holds no open tag, and the first one is followed by its newline: once
    # the tag is written, the newline and the call's opening up to the name are forced (drafted
    # for free) rather than left to the model one token per pass
    pre = f"pre: PRE\nPRE: TEXT {json.dumps(TOOL_CALL_OPEN + chr(10))}\n"
    return f"start: content | pre body {close}{repeat}\n{content}{pre}{no_call_text}{body}{more}"


# ---------------------------------------------------------------- compiled grammars


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar: `constraint()` makes each sequence's matcher."""

    text: str
    _template: Any  # an LLMatcher in its start state, deep-copied per sequence
    _compiler: GrammarCompiler
    prefix: tuple[int, ...] = ()  # tokens the template has consumed (`after`)

    def constraint(self) -> GrammarConstraint:
        return GrammarConstraint(self._live_template().deep_copy(), self._compiler)

    def after(self, tokens: list[int]) -> Grammar:
        """This grammar with `tokens` already written (a reply the prompt pre-fills); GrammarError
        where the grammar does not allow them."""
        matcher = self._live_template().deep_copy()
        if tokens and not matcher.consume_tokens(tokens):
            raise GrammarError(_short(matcher.get_error()))
        return Grammar(self.text, matcher, self._compiler, self.prefix + tuple(tokens))

    def _live_template(self) -> Any:
        """The template, or where it is in error a fresh one: llguidance shares a lexer between a
        matcher and its copies, and one copy failing can poison it. The text compiled, so that is
        the library's state, not the schema: compiled again, never remembered as a failure."""
        if not self._template.is_error():
            return self._template
        return self._compiler.renew(self)


class GrammarCompiler:
    """Compiles grammars for one tokenizer and keeps the last `cache_size` (schemas repeat in an
    agent loop: every turn sends the same tools).

    A text compiles in one of `workers` threads, each with its own grammar checker child
    (grammar_check.py): a text not known good is compiled there first, with the time bound
    (schema_limits.COMPILE), counted from when the child has it: time spent waiting for a free
    worker is not the schema's. Then it is compiled here, in a thread with 4x the stack the child
    had, so what compiled there compiles here."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int], cache_size: int = 64,
                 workers: int = 2) -> None:  # fmt: skip
        if llguidance is None:  # the install's fault, not the request's
            raise RuntimeError(
                "grammar-constrained decoding needs llguidance: pip install 'openalice-runner[engine]'"
            )
        self.vocab_size = vocab_size
        self.eos_ids = tuple(sorted(eos_ids))
        text = tokenizer_json(tokenizer)
        self._tokenizer = llg_tokenizer(text, vocab_size, self.eos_ids)
        self.closing_candidates = closing_candidates(tokenizer, vocab_size)  # the closing search's (closing.py)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._cached_chars = 0  # the cached grammars' text: what their matchers hold grows with it
        # texts that failed (by digest: a text can be megabytes), why, and the error's code
        self._failed: OrderedDict[bytes, tuple[str, str]] = OrderedDict()
        self._good: OrderedDict[bytes, None] = OrderedDict()  # texts the checker compiled (by digest)
        self._lock = threading.Lock()
        checker = GrammarChecker(text, vocab_size, self.eos_ids)
        self._checker = checker
        self._children: queue.SimpleQueue = queue.SimpleQueue()
        children = [checker.child() for _ in range(workers)]
        for child in children:
            self._children.put(child)
        self.children = children  # (tests look at them)
        weakref.finalize(self, _stop_children, children)
        self._pool = _WideStackPool(workers, thread_name_prefix="grammar-compile")
        self._queued = 0  # compiles waiting for a worker
        self.cache_size = cache_size
        # A compiled grammar holds ~80 bytes per character of its text (a 10,000-property schema:
        # 300 KB of text, 25 MB compiled), so the cache is bounded by text too: 64 such schemas held
        # 1.6 GB. 2 M characters: ~160 MB at most; a larger grammar is compiled each time it is asked for.
        self.cache_chars = 2_000_000

    def compile(self, text: str) -> Grammar:
        """The grammar for a Lark text (see json_grammar, tool_call_grammar); GrammarError names
        what is wrong with it (remembered: refused again at once), or that it took longer than the
        time bound (not remembered: a busy machine is not the schema's fault). EngineOverloaded
        where compiles are queued past the bounds of schema_limits.COMPILE."""
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return hit
            failed = self._failed.get(_digest(text))
            if failed is not None:
                raise GrammarError(failed[0], code=failed[1])
            if self._queued >= COMPILE.max_queued:
                raise EngineOverloaded(f"{self._queued} grammar compiles already wait for a compile worker")
            self._queued += 1
        started = threading.Event()
        future = self._pool.submit(self._job, text, started)
        if not started.wait(COMPILE.queue_timeout_s) and future.cancel():
            with self._lock:
                self._queued -= 1
            raise EngineOverloaded(f"no grammar compile worker was free within {COMPILE.queue_timeout_s:g} s")
        try:
            compiled = future.result(timeout=_RESULT_BOUND_S + 4 * COMPILE.timeout_s)
        except concurrent.futures.TimeoutError:  # pragma: no cover - the child is killed at its bound
            raise GrammarFault("a grammar compile did not finish within its bounds") from None
        except GrammarError as exc:
            if exc.code != "grammar_timeout":
                self._remember_failure(text, str(exc), exc.code)
            raise
        with self._lock:
            if len(text) <= self.cache_chars and text not in self._cache:
                self._cache[text] = compiled
                self._cached_chars += len(text)
            while len(self._cache) > self.cache_size or self._cached_chars > self.cache_chars:
                self._cached_chars -= len(self._cache.popitem(last=False)[0])
        return compiled

    def _job(self, text: str, started: threading.Event) -> Grammar:
        """In a compile worker: the checker's verdict on a text not known good, then the matcher."""
        with self._lock:
            self._queued -= 1
        started.set()
        digest = _digest(text)
        with self._lock:
            known = digest in self._good
        if not known:
            child = self._children.get()
            try:
                self._checker.check(child, text, COMPILE.timeout_s)
            finally:
                self._children.put(child)
            with self._lock:
                self._good[digest] = None
                while len(self._good) > 64 * self.cache_size:
                    self._good.popitem(last=False)
        return Grammar(text, build_matcher(text, self._tokenizer, self.vocab_size), self)

    def renew(self, grammar: Grammar) -> Any:
        """A fresh template for `grammar`, whose template is in error (Grammar._live_template);
        GrammarFault where the fresh one is in error too. The cache keeps the fresh one."""
        logger.warning("a compiled grammar was found in error (%s); compiling it again",
                       _short(grammar._template.get_error()))  # fmt: skip
        future = self._pool.submit(build_matcher, grammar.text, self._tokenizer, self.vocab_size)
        try:
            matcher = future.result(timeout=_RESULT_BOUND_S + 4 * COMPILE.timeout_s)
        except (GrammarError, concurrent.futures.TimeoutError) as exc:  # it compiled before
            raise GrammarFault(f"a grammar that compiled before failed to compile again: {exc}") from exc
        if matcher.is_error():
            raise GrammarFault(f"a grammar found in error is in error again on a fresh compile: "
                               f"{_short(matcher.get_error())}")
        with self._lock:
            if grammar.text in self._cache:
                self._cache[grammar.text] = Grammar(grammar.text, matcher, self)
        if grammar.prefix:
            matcher = matcher.deep_copy()
            if not matcher.consume_tokens(list(grammar.prefix)):
                raise GrammarFault(f"a grammar's prefill failed on a fresh compile: {_short(matcher.get_error())}")
        return matcher

    def _remember_failure(self, text: str, message: str, code: str = "invalid_value") -> None:
        with self._lock:
            self._failed[_digest(text)] = (message, code)
            while len(self._failed) > 4 * self.cache_size:
                self._failed.popitem(last=False)


class _WideStackPool(concurrent.futures.ThreadPoolExecutor):
    """A thread pool whose threads have COMPILE_STACK of stack (llguidance's compile recurses)."""

    def _adjust_thread_count(self) -> None:
        with _STACK_LOCK:
            before = threading.stack_size(COMPILE_STACK)
            try:
                super()._adjust_thread_count()
            finally:
                threading.stack_size(before)


COMPILE_STACK = 4 * CHECK_STACK
# what a compile may take beside its time bound: two children started (a crash is tried again) and slack
_RESULT_BOUND_S = 2 * START_TIMEOUT_S + 60
_STACK_LOCK = threading.Lock()


def _stop_children(children: list) -> None:
    for child in children:
        child.stop()


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()
