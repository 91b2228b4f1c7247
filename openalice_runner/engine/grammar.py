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
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from openalice_runner.engine.closing import closing_candidates
from openalice_runner.engine.errors import InvalidRequest
from openalice_runner.schema_limits import COMPILE

try:  # the engine extra installs it; the error says so where it is missing
    import llguidance
    import llguidance.hf
    import llguidance.numpy
except ImportError:  # pragma: no cover - exercised only without the engine extra
    llguidance = None

TOOL_CALL_OPEN = "<tool_call>"  # the fallback tool format's tags (providers/embedded/tool_format.py)
TOOL_CALL_CLOSE = "</tool_call>"


class GrammarError(InvalidRequest):
    """A grammar (or the JSON Schema it was built from) that cannot be compiled: the request's
    schema is at fault. A matcher that refuses a token its own mask allowed is a fault of ours
    (RuntimeError), not this."""


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
    """The JSON of one call in the fallback format: {"name": one tool, "arguments": its schema}."""
    options = []
    for tool in tools:
        fn = tool.get("function", tool)
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        options.append({
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    return options[0] if len(options) == 1 else {"anyOf": options}


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

    def constraint(self) -> GrammarConstraint:
        if self._template.is_error():  # llguidance shares a lexer between copies: one failing can poison it
            self._compiler.forget(self.text, _short(self._template.get_error()))
            raise GrammarError(f"the grammar failed: {_short(self._template.get_error())}")
        return GrammarConstraint(self._template.deep_copy(), self._compiler)

    def after(self, tokens: list[int]) -> Grammar:
        """This grammar with `tokens` already written (a reply the prompt pre-fills); GrammarError
        where the grammar does not allow them."""
        matcher = self._template.deep_copy()
        if tokens and not matcher.consume_tokens(tokens):
            raise GrammarError(_short(matcher.get_error()))
        return Grammar(self.text, matcher, self._compiler)


class GrammarCompiler:
    """Compiles grammars for one tokenizer and keeps the last `cache_size` (schemas repeat in an
    agent loop: every turn sends the same tools)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int], cache_size: int = 64):
        if llguidance is None:  # the install's fault, not the request's
            raise RuntimeError(
                "grammar-constrained decoding needs llguidance: pip install 'openalice-runner[engine]'"
            )
        self.vocab_size = vocab_size
        self.eos_ids = tuple(sorted(eos_ids))
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(self.eos_ids))
        self.closing_candidates = closing_candidates(tokenizer, vocab_size)  # the closing search's (closing.py)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._cached_chars = 0  # the cached grammars' text: what their matchers hold grows with it
        # texts that failed (by digest: a text can be megabytes), why, and the error's code
        self._failed: OrderedDict[bytes, tuple[str, str]] = OrderedDict()
        # Compiles run here, two at a time, so a request waits for its own with a time bound.
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self.cache_size = cache_size
        # A compiled grammar holds ~80 bytes per character of its text (a 10,000-property schema:
        # 300 KB of text, 25 MB compiled), so the cache is bounded by text too: 64 such schemas held
        # 1.6 GB. 2 M characters: ~160 MB at most; a larger grammar is compiled each time it is asked for.
        self.cache_chars = 2_000_000

    def compile(self, text: str) -> Grammar:
        """The grammar for a Lark text (see json_grammar, tool_call_grammar); GrammarError names
        what is wrong with it. Compiled in a worker with a time bound (schema_limits.COMPILE);
        a failure is remembered as a failure (refused again at once), never as a grammar."""
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return hit
            failed = self._failed.get(_digest(text))
            if failed is not None:
                raise GrammarError(failed[0], code=failed[1])
        timeout = COMPILE.timeout_s
        future = self._pool.submit(self._compile, text)
        try:
            compiled = future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            # The worker finishes on its own (llguidance cannot be interrupted); its result is dropped.
            message = f"compiling the schema's grammar took longer than {timeout:g} s (the server's --grammar-timeout)"
            self._remember_failure(text, message, "grammar_timeout")
            raise GrammarError(message, code="grammar_timeout") from None
        except GrammarError as exc:
            self._remember_failure(text, str(exc), exc.code)
            raise
        with self._lock:
            if len(text) <= self.cache_chars and text not in self._cache:
                self._cache[text] = compiled
                self._cached_chars += len(text)
            while len(self._cache) > self.cache_size or self._cached_chars > self.cache_chars:
                self._cached_chars -= len(self._cache.popitem(last=False)[0])
        return compiled

    def _compile(self, text: str) -> Grammar:
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
        except ValueError as exc:
            raise GrammarError(str(exc)) from exc
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise GrammarError(_short(messages[0]))
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_short(matcher.get_error()))
        _probe(matcher, self.vocab_size)
        return Grammar(text, matcher, self)

    def _remember_failure(self, text: str, message: str, code: str = "invalid_value") -> None:
        with self._lock:
            self._failed[_digest(text)] = (message, code)
            while len(self._failed) > 4 * self.cache_size:
                self._failed.popitem(last=False)

    def forget(self, text: str, message: str) -> None:
        """`text`'s grammar failed after it compiled: refuse it from now on instead of serving it."""
        with self._lock:
            if self._cache.pop(text, None) is not None:
                self._cached_chars -= len(text)
        self._remember_failure(text, f"the grammar failed: {message}")


def _probe(matcher: Any, vocab_size: int) -> None:
    """GrammarError where the grammar admits no reply, or fails on the bytes it forces first.

    On a copy: the tokens forced from the start (where llguidance builds the first lexemes: a
    `pattern` too large for its lexer fails here, not in the middle of a reply), then the mask
    after them, which is empty where nothing satisfies the schema (`{"$ref": "#"}`, a `$ref` cycle
    that never reaches a value). Such a grammar would otherwise end every reply at once with ""."""
    probe = matcher.deep_copy()
    forced = probe.compute_ff_tokens()
    if forced:
        probe.consume_tokens(forced)
    if probe.is_error():
        raise GrammarError(_short(probe.get_error()))
    if probe.is_accepting():
        return
    bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
    llguidance.numpy.fill_next_token_bitmask(probe, bitmask, 0)
    if probe.is_error() or not bitmask.any():  # llguidance's own word for it is "NoExtensionBias"
        raise GrammarError("no JSON value satisfies the schema (it is unsatisfiable, or a $ref cycle "
                           "never reaches a value)")
    # One step further for a few of the allowed tokens: where a schema is past llguidance's limits
    # (an object of thousands of properties), the first key is where it says so.
    allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_size])
    for token in allowed[:8].tolist():
        step = probe.deep_copy()
        if not step.consume_token(token):
            _past_limits(step)


# llguidance's resource limits (ParserLimits: items in a row, lexer fuel and states): a schema past
# them is the request's (e.g. an object of 5,000 properties: "Current row has 19999 items; max is 2000").
_LIMIT_ERROR = re.compile(r"max is \d+|too many|fuel|limit", re.IGNORECASE)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _past_limits(matcher: Any) -> None:
    """GrammarError where the matcher stopped at one of llguidance's limits (the schema's size)."""
    message = _short(matcher.get_error())
    if _LIMIT_ERROR.search(message):
        raise GrammarError(f"the schema's grammar is past the grammar backend's limits: {message}")


def _short(message: str) -> str:
    """llguidance's message without its parser state and grammar listing."""
    lines = []
    for line in message.split("\n<state>")[0].splitlines():
        if re.match(r"^\s*\d+ \| ", line):
            break
        if line.strip() and set(line.strip()) != {"^"}:
            lines.append(line.strip())
    return " ".join(lines)


# ---------------------------------------------------------------- one sequence's constraint


class GrammarConstraint:
    """The grammar state of one sequence: masks, forced tokens, draft checks, advancing."""

    def __init__(self, matcher, compiler: GrammarCompiler):
        """`matcher`: an llguidance LLMatcher (tests pass an automaton with its methods)."""
        self._matcher = matcher
        self._compiler = compiler
        self._bitmask = None
        self.mask_s = 0.0  # time spent computing masks (the benchmark reports it per token)
        self.masks = 0

    @property
    def vocab_size(self) -> int:
        return self._compiler.vocab_size

    def allowed(self) -> torch.Tensor:
        """(V,) bool: the tokens allowed next. A forced token is the only one allowed; EOS is
        allowed where the text so far is complete; never empty (a matcher in error allows EOS)."""
        t0 = time.perf_counter()
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        forced = self._matcher.compute_ff_tokens() if not self._matcher.is_stopped() else []
        if forced:
            allowed[forced[0]] = True
        else:
            allowed = self._grammar_mask()
            eos = list(self._compiler.eos_ids)
            if eos:
                allowed[eos] = bool(allowed[eos].any())  # any of the model's EOS ids, or none
                if not allowed.any():
                    allowed[eos] = True
        self.mask_s += time.perf_counter() - t0
        self.masks += 1
        return allowed

    def _grammar_mask(self) -> torch.Tensor:
        """(V,) bool: the matcher's own mask."""
        if self._bitmask is None:
            self._bitmask = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self.vocab_size]
        return torch.from_numpy(bits.astype(np.bool_))

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces from here (each is then the only allowed one)."""
        if limit <= 0 or self._matcher.is_stopped():
            return []
        return list(self._matcher.compute_ff_tokens()[:limit])

    def walk(self, draft: list[int]) -> tuple[int, torch.Tensor]:
        """Masks along a draft: (n, masks) where draft[:n] is the longest prefix every token of
        which its mask allows, and masks (n + 1, V) are the allowed sets after draft[:i] for
        i = 0..n. The matcher ends where it started."""
        n, masks, _ = self.walk_on(draft, 0)
        return n, masks

    def walk_on(self, draft: list[int], then_forced: int) -> tuple[int, torch.Tensor, list[int]]:
        """`walk`, and where the whole draft is allowed, on through up to `then_forced` tokens
        the grammar forces after it: (n, masks, forced_after), n and masks counting those too."""
        masks = [self.allowed()]
        n = 0
        for token in draft:
            if not bool(masks[-1][token]) or token in self._compiler.eos_ids:
                break
            self._consume(token)
            n += 1
            masks.append(self.allowed())
        after: list[int] = []
        if n == len(draft) and then_forced > 0:
            for token in self.forced(then_forced):
                if token in self._compiler.eos_ids:
                    break
                self._consume(token)
                after.append(token)
                masks.append(self.allowed())
        if n + len(after):
            self._matcher.rollback(n + len(after))
        return n + len(after), torch.stack(masks), after

    def _consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):  # pragma: no cover - the mask allowed it
            _past_limits(self._matcher)
            raise RuntimeError(f"grammar matcher refused a token its mask allowed: {_short(self._matcher.get_error())}")

    def advance(self, tokens: list[int]) -> None:
        """The sequence emitted `tokens` (EOS excluded): the matcher follows."""
        tokens = [t for t in tokens if t not in self._compiler.eos_ids]
        if tokens and not self._matcher.consume_tokens(tokens):  # the masks allowed them: ours
            _past_limits(self._matcher)
            raise RuntimeError(f"grammar matcher refused emitted tokens: {_short(self._matcher.get_error())}")

    @property
    def accepting(self) -> bool:
        """Whether the text so far is complete under the grammar."""
        return self._matcher.is_accepting()


def masked_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits (..., V') with the disallowed tokens at -inf (V' may exceed the mask's V: the
    model's padded rows beyond the tokenizer are never allowed)."""
    vocab = allowed.shape[-1]
    out = torch.full_like(logits, float("-inf"))
    keep = allowed.to(logits.device)
    out[..., :vocab] = logits[..., :vocab].masked_fill(~keep, float("-inf"))
    return out


def masked_probs(q: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """A draft distribution (k, V) restricted to the allowed tokens and renormalised (rows
    whose mass is all disallowed stay zero: their draft token was cut before verification)."""
    vocab = allowed.shape[-1]
    out = torch.zeros_like(q)
    out[..., :vocab] = q[..., :vocab] * allowed.to(q.dtype)
    total = out.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, out / total.clamp_min(1e-30), out)
