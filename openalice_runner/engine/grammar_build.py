"""Building one grammar's llguidance matcher from its Lark text, and what its failures mean.

Torch-free (llguidance and numpy only): the grammar checker's child process (grammar_check.py)
runs `build_matcher` on texts not yet known good, the server's own compile threads run it after
the child said yes (grammar.py).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from openalice_runner.engine.errors import InvalidRequest

try:  # the engine extra installs it; the error says so where it is missing
    import llguidance
    import llguidance.numpy
except ImportError:  # pragma: no cover - exercised only without the engine extra
    llguidance = None


class GrammarError(InvalidRequest):
    """A grammar (or the JSON Schema it was built from) that cannot be compiled: the request's
    schema is at fault. A matcher that refuses a token its own mask allowed is a fault of ours
    (RuntimeError), not this; so is a grammar that failed because of the library's state
    (`GrammarFault`)."""


class GrammarFault(RuntimeError):
    """A grammar that compiled failed in a way that comes from the grammar library's state, not from
    the schema (a compiled grammar found in error, again on a fresh compile): a 500, never
    remembered as the schema's fault."""


def tokenizer_json(hf_tokenizer: Any) -> str:
    """The fast tokenizer as the JSON llguidance reads (what llguidance.hf.from_tokenizer sends it),
    so that the server and the grammar checker's child build the same tokenizer."""
    from copy import copy

    backend = copy(hf_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


def llg_tokenizer(tokenizer_text: str, vocab_size: int, eos_ids: tuple[int, ...]) -> Any:
    return llguidance.LLTokenizer(tokenizer_text, n_vocab=vocab_size, eos_token=list(eos_ids))


def build_matcher(text: str, tokenizer: Any, vocab_size: int) -> Any:
    """An LLMatcher in its start state for the Lark `text`; GrammarError names what is wrong."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(text)
    except ValueError as exc:
        raise GrammarError(str(exc)) from exc
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise GrammarError(_short(messages[0]))
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(_short(matcher.get_error()))
    _probe(matcher, vocab_size)
    return matcher


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
