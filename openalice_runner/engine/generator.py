"""The decode loop: prefill, then rounds of (propose, verify in one target pass, roll back).

Plain decoding is the same round with nothing proposed, so one code path serves every method.
The state of one request lives in `Sequence` (sequence.py), one round's in `Round` (round.py);
`prefill` and `decode_round` are small functions over them, so a scheduler can interleave many
sequences (continuous batching, batching.py).

Cache invariant: the target's KV cache holds every token of `seq.tokens` except the last one
(`seq.tokens[-1]`, emitted but not yet fed). A round feeds that token plus k drafts, and rolls
the cache back to the accepted prefix by moving the slot's length pointer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import torch

from openalice_runner.engine.choice import choose_token
from openalice_runner.engine.drafters.base import observed_rows, taps_for
from openalice_runner.engine.llama import LlamaModel
from openalice_runner.engine.round import Round, plan_round
from openalice_runner.engine.sequence import Sequence, accept_tokens, begin, emit, final_event, preview_forced
from openalice_runner.engine.settle import settle_round
from openalice_runner.engine.tree import TreeMask
from openalice_runner.engine.types import StreamEvent

PREFILL_CHUNK = 512  # tokens per prefill pass: bounds the attention-score memory


def prefill(model: LlamaModel, seq: Sequence, reused: int = 0) -> list[int]:
    """Feed the prompt in chunks and pick the first token from its last position. `reused`: the
    cache already holds the first `reused` prompt tokens' keys and values (prefix reuse; at most
    all but the last prompt token, whose logits start the reply)."""
    start = time.perf_counter()
    seq.cache.lengths[seq.slot] = reused
    seq.stats.cached_prompt_tokens = reused
    hidden = None
    wants_hidden = seq.drafter is not None and seq.drafter.wants_hidden
    taps = taps_for([seq.drafter])
    times = seq.stats.first_token
    for i in range(reused, len(seq.prompt), PREFILL_CHUNK):
        t0 = time.perf_counter()
        chunk = torch.tensor([seq.prompt[i : i + PREFILL_CHUNK]])
        hidden, tapped = _forward(model, chunk, seq, taps, prompt=True)
        if wants_hidden:
            seq.drafter.observe(observed_rows(seq.drafter, hidden[0], tapped, taps))
        logits = model.logits(hidden[0, -1]) if i + PREFILL_CHUNK >= len(seq.prompt) else None
        times.chunks.append([chunk.shape[1], time.perf_counter() - t0])
    t0 = time.perf_counter()
    first = choose_token(logits, seq)
    times.first_token_s = time.perf_counter() - t0
    seq.stats.prefill_s = time.perf_counter() - start
    # The invariant holds again: `first` is the emitted but not yet fed last token.
    return accept_tokens(seq, [first])


def decode_round(model: LlamaModel, seq: Sequence, planned: Round) -> list[int]:
    """One target pass for one sequence: verify the round `plan_round` planned and emit 1..k+1
    tokens."""
    t0 = time.perf_counter()
    feed = torch.tensor([[seq.tokens[-1], *planned.draft]])  # (1, k+1)
    taps = taps_for([seq.drafter])
    hidden, tapped = _forward(model, feed, seq, taps, planned.tree_mask())
    logits = model.logits(hidden[0])  # (k+1, V)
    pass_s = time.perf_counter() - t0
    if seq.costs is not None:
        seq.costs.record(len(planned.draft) + 1, pass_s, context=planned.start + len(planned.draft) + 1)
    observed = hidden[0] if seq.drafter is None else observed_rows(seq.drafter, hidden[0], tapped, taps)
    return settle_round(seq, planned, logits, observed, pass_s)


def _forward(model: LlamaModel, feed: torch.Tensor, seq: Sequence, taps: tuple[int, ...],
             tree: TreeMask | None = None, prompt: bool = False):
    """(hidden (1, T, H), tapped row 0 (T, len(taps) * H) or None). `prompt`: prompt rows (their own kernels: `prompt_kernels`)."""
    extra = {} if tree is None else {"tree": tree}
    if prompt and getattr(model, "prompt_kernels", False):
        extra["prompt"] = True
    if not taps:
        return model.forward(feed, seq.cache, [seq.slot], **extra), None
    hidden, tapped = model.forward(feed, seq.cache, [seq.slot], taps, **extra)
    return hidden, tapped[0]


def run_sequence(model: LlamaModel, seq: Sequence, cancel: threading.Event | None = None,
                 reused: int = 0) -> Iterator[StreamEvent]:
    """Drive one sequence to the end on its own, yielding text as it is accepted (`reused`: see prefill)."""
    begin(seq)
    tokens = prefill(model, seq, reused)
    seq.stats.ttft_s = time.perf_counter() - seq.started
    planned = None
    while True:
        event = emit(seq, tokens, planned)
        if event is not None:
            yield event
        if seq.finished:
            break
        if cancel is not None and cancel.is_set():
            seq.finish_reason = "cancelled"
            break
        planned = plan_round(seq, seq.spec.gamma)
        preview = preview_forced(seq, planned)
        if preview is not None:
            yield preview
        tokens = decode_round(model, seq, planned)
    yield final_event(seq)
