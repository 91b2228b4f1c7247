"""Side by side: xgrammar and llguidance on SmolLM2's tokenizer (compile, per-token mask, rollback, forced tokens).

Run with both installed on a side path (not in the project venv):
    pip install --no-deps --target /tmp/gram xgrammar llguidance apache-tvm-ffi
    PYTHONPATH=/tmp/gram HF_HUB_OFFLINE=1 .venv/bin/python -m openalice_runner.bench.grammar_backends
"""

from __future__ import annotations

import json
import statistics
import time

import llguidance
import llguidance.hf
import llguidance.numpy
import xgrammar as xgr
from transformers import AutoTokenizer

from openalice_runner.engine.model_loading import converted_folder, default_model_source

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
REPLY = json.dumps({"city": "Paris, France", "unit": "celsius", "days": 3})
KEY_OPEN = '{"city": "Paris", "'


def stats(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"median {statistics.median(xs) * 1e6:.0f} us, p90 {xs[int(len(xs) * 0.9)] * 1e6:.0f} us"


def fresh_schemas(n: int) -> list[dict]:
    """Schemas that differ, so that no backend cache answers."""
    out = []
    for i in range(n):
        props = dict(SCHEMA["properties"], **{f"x{i}": {"type": "boolean"}})
        out.append(dict(SCHEMA, properties=props))
    return out


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def llguidance_figures(tok, ids: list[int]) -> None:
    vocab = len(tok)
    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    print(f"llguidance tokenizer init {time.perf_counter() - start:.2f}s")

    def compile_one(schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        return llguidance.LLMatcher(lltok, grammar, log_level=0)

    print("llguidance compile (5 fresh schemas)", stats([timed(lambda s=s: compile_one(s)) for s in fresh_schemas(5)]))
    bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab)
    times = []
    for _ in range(5):
        matcher = compile_one(SCHEMA)
        for tid in ids:
            times.append(timed(lambda m=matcher: llguidance.numpy.fill_next_token_bitmask(m, bitmask, 0)))
            assert matcher.consume_token(tid), matcher.get_error()
        assert matcher.is_accepting()
    print("llguidance mask per token", stats(times))
    matcher = compile_one(SCHEMA)
    matcher.consume_tokens(ids[:5])
    print("llguidance rollback(3):", matcher.rollback(3), "then", matcher.validate_tokens(ids[2:]), "of", len(ids) - 2, "valid")
    matcher = compile_one(SCHEMA)
    matcher.consume_tokens(tok.encode(KEY_OPEN, add_special_tokens=False))
    print("llguidance forced tokens after", repr(KEY_OPEN), [tok.decode([t]) for t in matcher.compute_ff_tokens()])


def xgrammar_figures(tok, ids: list[int]) -> None:
    vocab = len(tok)
    start = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab), max_threads=2)
    print(f"xgrammar tokenizer init {time.perf_counter() - start:.2f}s")
    print(
        "xgrammar compile (5 fresh schemas)",
        stats([timed(lambda s=s: compiler.compile_json_schema(json.dumps(s))) for s in fresh_schemas(5)]),
    )
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for _ in range(5):
        matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=16)
        for tid in ids:
            times.append(timed(lambda m=matcher: m.fill_next_token_bitmask(bitmask, 0)))
            assert matcher.accept_token(tid)
    print("xgrammar mask per token", stats(times))
    matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=16)
    for tid in ids[:5]:
        matcher.accept_token(tid)
    matcher.rollback(3)
    print("xgrammar rollback(3): ok, then", sum(bool(matcher.accept_token(t)) for t in ids[2:]), "accepted")
    matcher = xgr.GrammarMatcher(compiled)
    for tid in tok.encode(KEY_OPEN, add_special_tokens=False):
        matcher.accept_token(tid)
    print("xgrammar jump-forward string after", repr(KEY_OPEN), repr(matcher.find_jump_forward_string()))


def main() -> None:
    tok = AutoTokenizer.from_pretrained(converted_folder(default_model_source()))
    ids = tok.encode(REPLY, add_special_tokens=False)
    print(f"vocabulary {len(tok)}; reply of {len(ids)} tokens: {REPLY}")
    llguidance_figures(tok, ids)
    xgrammar_figures(tok, ids)


if __name__ == "__main__":
    main()
