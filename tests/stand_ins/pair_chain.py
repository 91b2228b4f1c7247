"""A second-order Markov chain that reads its context from its cache, an independent reference
for its sampling distributions, and the sequential chi-square test of the exactness tests that
run drafts of every length (tests/test_engine_exact_*.py; docs/testing.md says why this design).

- The model's next-token distribution depends on the fed token and the one before it, and that
  one is read from what the cache holds at the position before (a tree node: its parent's). A
  first-order chain that ignores its cache cannot see rollback faults (a kept rejected draft, a
  dropped bonus token that leaves the cache one ahead): this one can, as a transformer would.
- The reference re-implements temperature, top-k and top-p over sorted Python lists; no engine
  code is used to compute what the output should be.
- Replies are long (γ + 2 tokens or more), so every γ drafts its full length. The joint of 4^8
  replies is too sparse for a chi-square test at any N a test can afford, so the test checks the
  next-token distribution at each reply position given the two tokens before it, which for a
  second-order chain is the whole of what the joint says (the chain's output is exact if and
  only if each position's token, given everything before, follows the row of its two previous
  tokens). Conditional on the past, each (position, state) group's counts are multinomial with
  the reference row, so the groups' Pearson statistics add up to one chi-square.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from scipy.stats import chi2

from openalice_runner.engine.drafters.base import Drafter, Proposal
from openalice_runner.engine.generator import run_sequence
from openalice_runner.engine.sampling import processed_probs
from openalice_runner.engine.sequence import SequenceRequest, Target, new_sequence
from openalice_runner.engine.types import SamplingParams

VOCAB = 4
HIDDEN = VOCAB * VOCAB  # a row's "hidden state": one-hot of (previous token, token)
START = 0  # the token the chain reads before the first position
PROMPT = [1, 2]


def random_pair_chain(seed: int) -> torch.Tensor:
    """(V * V, V): row `a * V + b` is the next-token distribution after tokens a, b."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.rand(HIDDEN, VOCAB, generator=gen) ** 2 + 0.02
    return table / table.sum(-1, keepdim=True)


# ---- the model and its cache ------------------------------------------------------------------
class PairCache:
    """Per slot, the token at each position; `lengths` is the engine's pointer (rollback moves it,
    the entries above it stay, stale, as in a real cache). The serial engine uses slot 0; the
    batching scheduler calls `grow`."""

    def __init__(self, batch: int = 1, max_len: int = 128):
        self.lengths = [0] * batch
        self.max_len = max_len
        self.store: list[dict[int, int]] = [{} for _ in range(batch)]

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def grow(self, batch: int, max_len: int) -> None:
        self.lengths += [0] * (batch - self.batch)
        self.store += [{} for _ in range(batch - len(self.store))]
        self.max_len = max(self.max_len, max_len)

    def keep(self, slot: int, sources: list[int], start: int) -> None:
        moved = [self.store[slot][s] for s in sources]
        for d, token in enumerate(moved):
            self.store[slot][start + d] = token

    def before(self, slot: int, visible: list[int]) -> int:
        """The token at the last position a row sees before its own (START at position 0)."""
        if len(visible) < 2:
            return START
        return self.store[slot][visible[-2]]  # a KeyError: the row reads a position never written


class PairModel:
    """`forward` (serial) and `forward_rows` (batching) write the fed tokens into the cache, then
    give each row the one-hot of (the token it sees before it, its token); `logits` looks up the
    chain's row. With `taps`, stand-ins for earlier layers' residual streams (the same rows, scaled)."""

    prefill_bf16 = False

    def __init__(self, table: torch.Tensor):
        self.log_table = table.log()
        self.vocab_size = table.shape[-1]

    def new_cache(self, batch: int, max_len: int) -> PairCache:
        return PairCache(batch, max_len)

    def forward(self, tokens: torch.Tensor, cache: PairCache, slots: list[int], taps=(), tree=None):
        slot, start = slots[0], cache.lengths[slots[0]]
        count = tokens.shape[1]
        hidden = self._rows(tokens[0].tolist(), cache, [slot] * count, list(range(start, start + count)), tree)
        cache.lengths[slot] += count
        return self._out(hidden.unsqueeze(0), taps)

    def forward_rows(self, tokens: torch.Tensor, cache: PairCache, row_slot, row_pos, taps=(), tree=None,
                     prompt_spans=None):
        return self._out(self._rows(tokens.tolist(), cache, list(row_slot), list(row_pos), tree), taps)

    def _rows(self, tokens, cache, slots, positions, tree) -> torch.Tensor:
        for token, slot, pos in zip(tokens, slots, positions, strict=True):
            cache.store[slot][pos] = token
        pairs = []
        for r, (token, slot, pos) in enumerate(zip(tokens, slots, positions, strict=True)):
            visible = list(range(pos + 1)) if tree is None else tree.visible(r, pos)
            pairs.append(cache.before(slot, visible) * VOCAB + token)
        return torch.nn.functional.one_hot(torch.tensor(pairs), HIDDEN).float()

    @staticmethod
    def _out(hidden, taps):
        if not taps:
            return hidden
        return hidden, torch.cat([hidden * (2.0 + i) for i in taps], dim=-1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.log_table[hidden.argmax(-1)]


class SilentTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return ""


class PairDrafter(Drafter):
    """Drafts from its own second-order chain q (a draft model's stand-in): sampled, or its argmax."""

    samples = True

    def __init__(self, table: torch.Tensor, deterministic: bool = False):
        self.log_table = table.log()
        self.deterministic = deterministic
        self.samples = not deterministic

    def propose(self, history, gamma, sampling, generator):
        tokens, rows = [], []
        a, b = history[-2], history[-1]
        for _ in range(gamma):
            probs = processed_probs(self.log_table[a * VOCAB + b], sampling)
            if self.deterministic:
                token = int(probs.argmax())
            else:
                token = int(torch.multinomial(probs, 1, generator=generator))
                rows.append(probs)
            tokens.append(token)
            a, b = b, token
        return Proposal(tokens, None if self.deterministic else torch.stack(rows))


def random_eagle_runtime(seed: int, feature_layers: list[int] | None = None):
    """A random EAGLE head over the model's one-hot (previous, token) hidden states."""
    from openalice_runner.engine.eagle.head import EagleHead, EagleRuntime, HeadConfig

    torch.manual_seed(seed)
    cfg = HeadConfig(hidden=HIDDEN, n_heads=2, n_kv_heads=1, head_dim=8, intermediate=32, eps=1e-5,
                     rope_theta=10000.0, max_positions=128, target={}, draft_vocab=[3, 1, 0, 2],
                     feature_layers=feature_layers)
    head = EagleHead(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.5)
    target = SimpleNamespace(weight_dtype=torch.float32, embed=torch.randn(VOCAB, HIDDEN),
                             lm_head=SimpleNamespace(weight=torch.randn(VOCAB, HIDDEN)))
    return EagleRuntime(head, target)


def random_eagle3_runtime(seed: int, draft_vocab: tuple[int, ...] = (0, 1, 3)):
    """A random head in the EAGLE-3 layout (eagle3.py: what vLLM and SGLang run) reading three taps
    (stand-ins: scaled rows), its pre-norm output fed back; by default its draft vocabulary leaves
    a token out (q is 0 there, p is not)."""
    from openalice_runner.engine.eagle.eagle3 import Eagle3Config, Eagle3Head, Eagle3Runtime

    torch.manual_seed(seed)
    cfg = Eagle3Config(hidden=HIDDEN, n_heads=2, n_kv_heads=1, head_dim=8, intermediate=32, eps=1e-5,
                       rope_theta=10000.0, max_positions=128, vocab_size=VOCAB, draft_vocab=list(draft_vocab),
                       feature_layers=[0, 1, 2], target=None)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.5)
    return Eagle3Runtime(head, SimpleNamespace(weight_dtype=torch.float32, embed=torch.randn(VOCAB, HIDDEN)))


# ---- the independent reference ------------------------------------------------------------------
def plain_probs(logits: list[float], temperature: float, top_k: int = 0, top_p: float = 1.0,
                allowed: list[bool] | None = None) -> list[float]:
    """The sampling distribution written out plainly: drop forbidden tokens, divide by the
    temperature, keep the top_k highest scores (ties at the k-th kept), softmax, then keep the most
    likely tokens until the mass before the next one reaches top_p, and renormalise."""
    vocab = len(logits)
    keep = [allowed is None or allowed[i] for i in range(vocab)]
    scores = [logits[i] / temperature for i in range(vocab)]
    if 0 < top_k < sum(keep):
        kth = sorted((scores[i] for i in range(vocab) if keep[i]), reverse=True)[top_k - 1]
        keep = [keep[i] and scores[i] >= kth for i in range(vocab)]
    top = max(scores[i] for i in range(vocab) if keep[i])
    weights = [math.exp(scores[i] - top) if keep[i] else 0.0 for i in range(vocab)]
    total = sum(weights)
    probs = [w / total for w in weights]
    if top_p < 1.0:
        order = sorted(range(vocab), key=lambda i: -probs[i])
        kept, mass = [0.0] * vocab, 0.0
        for i in order:
            if mass >= top_p or probs[i] == 0.0:
                break
            kept[i] = probs[i]
            mass += probs[i]
        probs = [x / mass for x in kept]
    return probs


def reference_rows(table: torch.Tensor, sampling: SamplingParams,
                   allowed: torch.Tensor | None = None) -> dict[tuple[int, int], list[float]]:
    """For each state (a, b), the distribution of the token after a, b; `allowed` (V, V): the
    grammar's allowed tokens after b. The logits are the model's own fp32 values."""
    logits = table.log().tolist()
    mask = None if allowed is None else allowed.tolist()
    return {(a, b): plain_probs(logits[a * VOCAB + b], sampling.temperature, sampling.top_k, sampling.top_p,
                                None if mask is None else mask[b])
            for a in range(VOCAB) for b in range(VOCAB)}


def sample_reference(rows, prompt: list[int], length: int, n: int, seed: int,
                     changed=None, changed_from: int = 0) -> list[tuple[int, ...]]:
    """Replies drawn straight from the reference rows (the test's level and power checks); with
    `changed`, from those rows instead at reply positions `changed_from` and later."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, reply = prompt[-2], prompt[-1], []
        for t in range(length):
            row = (changed if changed is not None and t >= changed_from else rows)[(a, b)]
            token = rng.choices(range(VOCAB), row)[0]
            reply.append(token)
            a, b = b, token
        out.append(tuple(reply))
    return out


def moved_rows(rows, tv: float):
    """Each row moved by exactly `tv` in total variation, from its most likely token to the others
    in proportion to their mass: a direction the chi-square sees little of (docs/testing.md)."""
    out = {}
    for state, row in rows.items():
        j = max(range(len(row)), key=lambda i: row[i])
        rest = 1.0 - row[j]
        e = min(tv, row[j]) if rest > 0 else 0.0
        out[state] = [x - e if i == j else x + e * x / rest for i, x in enumerate(row)] if e else list(row)
    return out


# ---- the test -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChiSquare:
    p: float
    statistic: float
    df: int
    impossible: int  # tokens the reference gives no mass (p is then 0)


MIN_EXPECTED = 5.0  # cells expected below this are pooled (the chi-square approximation needs it)


def sequential_chi_square(replies: list[tuple[int, ...]], rows, prompt: list[int] = PROMPT) -> ChiSquare:
    """Pearson's test of every (reply position, two previous tokens) group's next-token counts
    against the reference row: `rows[(a, b)]`, or `rows(t, a, b)` where the row depends on the
    reply position t too (a budget's end). Within a group the smallest cells are pooled until the pool expects
    MIN_EXPECTED; a group expecting less than that in all is left out (its counts stay in the
    states of the next position). Which groups and pools enter depends only on the counts of the
    states, fixed before the tokens they test are drawn, so the test keeps its level."""
    groups: dict[tuple[int, int, int], list[int]] = defaultdict(lambda: [0] * VOCAB)
    for reply in replies:
        a, b = prompt[-2], prompt[-1]
        for t, token in enumerate(reply):
            groups[(t, a, b)][token] += 1
            a, b = b, token
    statistic, df, impossible = 0.0, 0, 0
    for (t, a, b), counts in groups.items():
        probs, n = (rows(t, a, b) if callable(rows) else rows[(a, b)]), sum(counts)
        impossible += sum(c for c, q in zip(counts, probs, strict=True) if q == 0.0)
        cells = sorted(((n * q, c) for c, q in zip(counts, probs, strict=True) if q > 0.0))
        bins: list[list[float]] = []
        pool = [0.0, 0.0]
        for expected, observed in cells:
            if pool[0] < MIN_EXPECTED:
                pool = [pool[0] + expected, pool[1] + observed]
            else:
                bins.append([expected, observed])
        if pool[0] >= MIN_EXPECTED:
            bins.append(pool)
        elif bins:  # the small cells' pool joins the smallest bin
            bins[0] = [bins[0][0] + pool[0], bins[0][1] + pool[1]]
        if len(bins) < 2:
            continue
        statistic += sum((o - e) ** 2 / e for e, o in bins)
        df += len(bins) - 1
    if impossible:
        return ChiSquare(0.0, math.inf, df, impossible)
    return ChiSquare(float(chi2.sf(statistic, df)), statistic, df, 0)


# ---- running the engine ----------------------------------------------------------------------------
@dataclass
class Rounds:
    """The drafter's rounds over many replies, from GenerationStats.draft_depth_histogram."""

    by_depth: dict[int, list[int]]

    @classmethod
    def empty(cls) -> Rounds:
        return cls({})

    def add(self, histogram: list[list[int]]) -> None:
        for depth, row in enumerate(histogram):
            mine = self.by_depth.setdefault(depth, [0] * (depth + 1))
            for accepted, count in enumerate(row):
                mine[accepted] += count

    def full(self, depth: int) -> int:
        """Rounds whose draft reached `depth` (or deeper)."""
        return sum(sum(row) for d, row in self.by_depth.items() if d >= depth)

    def accepted_at_least(self, k: int) -> int:
        """Rounds that accepted `k` or more of the drafter's tokens (an acceptance at position k)."""
        return sum(sum(row[k:]) for row in self.by_depth.values())

    def late_rejections(self) -> int:
        """Rounds that accepted one or more tokens and then stopped short of the draft's depth (for
        a chain: rejected a token at position 2 or later)."""
        return sum(sum(row[1:d]) for d, row in self.by_depth.items())

    def full_accepts(self, depth: int) -> int:
        """Rounds that accepted a draft of `depth` tokens whole (a bonus token followed)."""
        row = self.by_depth.get(depth)
        return row[depth] if row else 0

    def summary(self, gamma: int) -> str:
        return (f"full-length {self.full(gamma)}, accepted at 2+ {self.accepted_at_least(2)}, "
                f"late rejections {self.late_rejections()}, whole accepts {self.full_accepts(gamma)}")


@dataclass
class Run:
    replies: list[tuple[int, ...]]
    rounds: Rounds
    forced: int = 0  # tokens a grammar forced, over all replies
    proposed: int = 0
    closing: int = 0  # tokens forced to close the grammar within the budget (closing.py), over all replies


def check_lengths(run: Run, gamma: int, n: int, late: bool = True) -> None:
    """The drafter drafted its full γ in many rounds; with `late`, tokens at draft positions 2+
    were accepted, drafts were rejected after an acceptance, many times, and whole drafts of γ
    were accepted (a bonus token followed)."""
    r = run.rounds
    summary = r.summary(gamma)
    assert r.full(gamma) > n // 4, summary
    if late and gamma >= 2:
        assert r.accepted_at_least(2) > n // 20, summary
        assert r.late_rejections() > n // 20, summary
        assert r.full_accepts(gamma) > 0, summary


def report(result: ChiSquare, run: Run, gamma: int) -> None:
    """What the run showed (pytest -rP prints it; docs/testing.md quotes it)."""
    print(f"p={result.p:.3g} chi2={result.statistic:.1f} df={result.df}; {run.rounds.summary(gamma)}; "
          f"depths {run.rounds.by_depth}")


def sample_serial(model, make_drafter, sampling: SamplingParams, spec, n: int, seed: int | None,
                  prompt: list[int] = PROMPT, constraint=None) -> Run:
    """n replies of the serial engine, seeds seed * 100_000 + i (None: unseeded requests), each
    with a fresh drafter."""
    run = Run([], Rounds.empty())
    for i in range(n):
        s = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                           seed=None if seed is None else seed * 100_000 + i, max_tokens=sampling.max_tokens)
        seq = new_sequence(SequenceRequest(prompt, s, spec, make_drafter(), None if constraint is None else constraint()),
                           Target(PairCache(), SilentTokenizer(), frozenset(), context_length=128))
        result = None
        for event in run_sequence(model, seq):
            result = event.result or result
        run.replies.append(tuple(result.token_ids))
        run.rounds.add(result.stats.draft_depth_histogram)
        run.forced += result.stats.forced
        run.proposed += result.stats.proposed
        run.closing += result.stats.closing
    return run


def sample_batched(model, jobs, sampling: SamplingParams, n: int, seed: int, max_batch: int = 8) -> Run:
    """n replies through the batching scheduler, 64 submitted at a time; request i runs
    jobs[i % len(jobs)] = (prompt, max_tokens, spec, make_drafter), so one pass holds sequences of
    different prompt and reply lengths, γ and drafters (and prompt chunks beside decode rows)."""
    from openalice_runner.engine.batching import BatchScheduler

    scheduler = BatchScheduler(model, max_batch=max_batch)
    run = Run([], Rounds.empty())
    try:
        for group in range(0, n, 64):
            requests = []
            for i in range(group, min(group + 64, n)):
                prompt, max_tokens, spec, make = jobs[i % len(jobs)]
                s = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                   seed=seed * 100_000 + i, max_tokens=max_tokens)
                seq = new_sequence(SequenceRequest(prompt, s, spec, make()),
                                   Target(scheduler.cache, SilentTokenizer(), frozenset(), context_length=128), slot=-1)
                requests.append(scheduler.submit(seq))
            for request in requests:
                result = [e.result for e in scheduler.events(request) if e.result is not None][0]
                run.replies.append(tuple(result.token_ids))
                run.rounds.add(result.stats.draft_depth_histogram)
                run.proposed += result.stats.proposed
    finally:
        scheduler.close()
    return run


# ---- a grammar over the chain's tokens ----------------------------------------------------------
# An automaton whose state is the last token: after 1 only 3 is allowed and after 3 only 2 (a
# forced span of two tokens), after 0 and 2 three tokens each. GrammarConstraint runs unchanged
# over it (its mask is the automaton's row).
GRAMMAR_ROWS = torch.tensor([[False, True, True, True],
                             [False, False, False, True],
                             [True, True, False, True],
                             [False, False, True, False]])


class ChainGrammar:
    """The LLMatcher methods GrammarConstraint and the closing search call, for an automaton whose
    state is the last token: `rows` (V, V) its allowed tokens after each (GRAMMAR_ROWS above),
    `accepting` the states a reply may end in (None: every one)."""

    def __init__(self, start: int, rows: torch.Tensor = GRAMMAR_ROWS, accepting: frozenset[int] | None = None):
        self.states = [start]
        self.error = ""
        self.rows = rows
        self.accepting = accepting

    def is_stopped(self):
        return False

    def is_accepting(self):
        return self.accepting is None or self.states[-1] in self.accepting

    def is_error(self):
        return bool(self.error)

    def get_error(self):
        return self.error

    def compute_ff_tokens(self):
        out, state = [], self.states[-1]
        while len(out) < 8 and int(self.rows[state].sum()) == 1:
            state = int(self.rows[state].nonzero()[0, 0])
            out.append(state)
        return out

    def consume_token(self, token):
        if not self.rows[self.states[-1], token]:
            self.error = f"token {token} is not allowed after {self.states[-1]}"
            return False
        self.states.append(token)
        return True

    def consume_tokens(self, tokens):
        return all(self.consume_token(t) for t in tokens)

    def rollback(self, n):
        del self.states[len(self.states) - n :]
        return True


def grammar_drafts(seed: int, rows: torch.Tensor = GRAMMAR_ROWS) -> torch.Tensor:
    """A draft chain that mostly keeps to the grammar `rows` (so drafts run long before a forbidden
    token cuts them), with a tenth of the weight left on forbidden tokens."""
    table = random_pair_chain(seed)
    allowed = rows.repeat(VOCAB, 1)  # row a * V + b: the grammar's row after b
    table = table * (allowed.float() * 0.9 + 0.1)
    return table / table.sum(-1, keepdim=True)


def chain_constraint(last: int = PROMPT[-1], rows: torch.Tensor = GRAMMAR_ROWS,
                     accepting: frozenset[int] | None = None):
    """GrammarConstraint over ChainGrammar (its mask: the automaton's row), from state `last`."""
    from openalice_runner.engine.grammar import GrammarConstraint

    class ChainConstraint(GrammarConstraint):
        def _grammar_mask(self):
            return self._matcher.rows[self._matcher.states[-1]].clone()

    return ChainConstraint(ChainGrammar(last, rows, accepting), SimpleNamespace(vocab_size=VOCAB, eos_ids=()))
