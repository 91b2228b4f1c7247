"""Continuous batching: concurrent requests share target passes and stay exact.

- Greedy output of every request in a batch of mixed methods and γ equals its serial `off`
  output (fp32; and bf16 too where the engine's row-invariant kernels run).
- The chi-square test of the sampling path, run through the batch scheduler with mixed γ and
  drafters at full draft length, matches the target's plain reference, and fails with a broken sampler.
- Admission, retirement, cancellation, the per-step γ policy and the bounded waiting line.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from stand_ins.drafters import OracleDrafter
from stand_ins.engines import run_concurrently
from stand_ins.pair_chain import (
    PROMPT,
    PairDrafter,
    PairModel,
    random_pair_chain,
    reference_rows,
    sample_batched,
    sequential_chi_square,
)

from openalice_runner.engine import Engine, SamplingParams, SpecConfig, rejection
from openalice_runner.engine.batching import BatchScheduler
from openalice_runner.engine.cpu_kernels import cpu_kernels
from openalice_runner.engine.sequence import SequenceRequest, Target, new_sequence
from openalice_runner.engine.types import EngineOverloaded
from openalice_runner.speculation import GammaTable

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def f(x):\n    return x + 1\n\ndef g(x):\n    return",
    "one two three four five one two three",
    "Summarise: the cat sat on the mat. The cat sat on the mat because",
    "a",
    "import os\nimport sys\nimport os\nimport",
]
SPECS = [
    SpecConfig(method="off"),
    SpecConfig(method="ngram", gamma=1),
    SpecConfig(method="ngram", gamma=3),
    SpecConfig(method="ngram", gamma=8),
    SpecConfig(method="draft", gamma=3, draft_layers=2),
    SpecConfig(method="ngram", gamma=5),
]



@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_batched_greedy_equals_serial_off_with_mixed_methods(dtype):
    if dtype == "bf16" and cpu_kernels() is None:
        pytest.skip("bf16 rows agree across batch shapes only with the engine's kernels")
    serial = Engine.tiny_random(seed=3, dtype=dtype, max_batch=1)
    batched = Engine.tiny_random(seed=3, dtype=dtype, max_batch=4)  # 8 jobs: some wait for a slot
    sampling = SamplingParams(max_tokens=32)
    prompts = [serial.encode(p) for p in PROMPTS]
    reference = [serial.generate(p, sampling, SpecConfig(method="off")) for p in prompts]
    vocab = serial.model.cfg.vocab_size
    jobs = [(p, sampling, spec, None) for p, spec in zip(prompts, SPECS, strict=True)]
    jobs.append((prompts[0], sampling, SpecConfig(method="draft", gamma=4),
                 OracleDrafter(len(prompts[0]), reference[0].token_ids, vocab, accept=True)))
    jobs.append((prompts[1], sampling, SpecConfig(method="draft", gamma=4),
                 OracleDrafter(len(prompts[1]), reference[1].token_ids, vocab, accept=False)))
    results = run_concurrently(batched, jobs)
    expected = reference + [reference[0], reference[1]]
    for job, got, want in zip(jobs, results, expected, strict=True):
        assert got.token_ids == want.token_ids, job[2]
        assert got.text == want.text
    assert results[6].stats.acceptance_rate == 1.0
    assert results[7].stats.accepted == 0
    # they really shared passes: fewer steps than the rounds they ran one by one
    assert batched.scheduler.steps < sum(r.stats.target_passes for r in results)


# ---- sampling exactness through the scheduler, at full draft length ------------------------------
# The second-order chain of stand_ins/pair_chain.py with replies of γ + 3 tokens or more (three-token
# replies drafted one token at most), against its plain reference rows (the sequential chi-square;
# docs/testing.md, "Exactness at every draft length").
N = 2500



def _mixed_jobs(draft):
    # mixed γ, sampled and one-hot drafts, and plain sequences in one batch, replies of γ + 3 to 8
    return [(PROMPT, 5, SpecConfig(method="draft", gamma=1), lambda: PairDrafter(draft)),
            (PROMPT, 6, SpecConfig(method="draft", gamma=3), lambda: PairDrafter(draft, True)),
            (PROMPT, 8, SpecConfig(method="draft", gamma=5), lambda: PairDrafter(draft)),
            (PROMPT, 7, SpecConfig(method="off"), lambda: None)]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_batched_sampling_keeps_the_target_at_full_length(top_p):
    target, draft = random_pair_chain(1), random_pair_chain(2)
    sampling = SamplingParams(temperature=0.9, top_p=top_p)
    run = sample_batched(PairModel(target), _mixed_jobs(draft), sampling, N, seed=11)
    r, summary = run.rounds, run.rounds.summary(5)
    assert r.full(5) > N // 8 and r.full(3) > N // 4 and r.full_accepts(5) > 0, summary  # a quarter are γ 5
    assert r.accepted_at_least(2) > N // 20 and r.late_rejections() > N // 20, summary
    assert {len(x) for x in run.replies} == {5, 6, 8, 7}
    result = sequential_chi_square(run.replies, reference_rows(target, sampling))
    print(f"p={result.p:.3g} chi2={result.statistic:.1f} df={result.df}; {summary}; depths {r.by_depth}")
    assert result.p > 1e-3, (result, r.by_depth)


@pytest.mark.usefixtures("one_thread")
def test_batched_broken_sampler_is_caught(monkeypatch):
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q, token: p)
    target, draft = random_pair_chain(1), random_pair_chain(2)
    sampling = SamplingParams(temperature=0.9)
    jobs = [(PROMPT, 6, SpecConfig(method="draft", gamma=3), lambda: PairDrafter(draft))]
    run = sample_batched(PairModel(target), jobs, sampling, N, seed=12)
    r, summary = run.rounds, run.rounds.summary(3)
    assert r.full(3) > N // 4 and r.accepted_at_least(2) > N // 20 and r.late_rejections() > N // 20, summary
    assert r.full_accepts(3) > 0, summary
    result = sequential_chi_square(run.replies, reference_rows(target, sampling))
    print(f"p={result.p:.3g} chi2={result.statistic:.1f} df={result.df}; {summary}")
    assert result.p < 1e-6, result


def test_gamma_table_sees_the_batch_and_sets_gamma_per_step():
    engine = Engine.tiny_random(seed=4, max_batch=4)
    seen: list[int] = []
    lock = threading.Lock()

    class RecordingTable(GammaTable):  # the table the policy compiles, and what the steps asked of it
        __slots__ = ()

        def at(self, batch_size: int) -> int:
            with lock:
                seen.append(batch_size)
            return GammaTable.at(self, batch_size)

    no_drafts_when_crowded = RecordingTable(((1, 4), (2, 0)))
    spec = SpecConfig(method="ngram", gamma=8, per_batch=no_drafts_when_crowded)
    prompt = engine.encode("one two three one two three one two three one two")
    sampling = SamplingParams(max_tokens=24)
    barrier = threading.Barrier(3)

    def one(_):
        barrier.wait()
        return engine.generate(prompt, sampling, spec)

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(one, range(3)))
    assert max(seen) == 3
    # while all three ran, nothing was drafted; alone at the end, drafts resume
    assert all(r.token_ids == results[0].token_ids for r in results)
    alone = engine.generate(prompt, sampling, spec)
    assert alone.stats.proposed > 0


def test_cancelled_and_abandoned_streams_free_their_slots():
    engine = Engine.tiny_random(seed=5, max_batch=2)
    prompt = engine.encode("hello there")
    long = SamplingParams(max_tokens=400)
    cancel = threading.Event()
    stream = engine.stream(prompt, long, SpecConfig(), cancel=cancel)
    next(stream)
    cancel.set()
    last = [e for e in stream][-1]
    assert last.result.finish_reason == "cancelled"
    abandoned = engine.stream(prompt, long, SpecConfig())
    next(abandoned)
    abandoned.close()  # the consumer left: the scheduler retires it at its next step
    # both slots are free again: two more requests run to the end
    results = run_concurrently(engine, [(prompt, SamplingParams(max_tokens=8), SpecConfig(), None)] * 2)
    assert all(r.stats.completion_tokens == 8 for r in results)


def test_full_waiting_line_is_refused_at_once():
    engine = Engine.tiny_random(seed=6, max_batch=2)
    engine.scheduler.max_waiting = 0
    with pytest.raises(EngineOverloaded):
        engine.generate(engine.encode("hi"), SamplingParams(max_tokens=4))


def _drain(scheduler, request):
    return [e.result for e in scheduler.events(request) if e.result is not None][0]


def test_kv_cache_is_sized_by_the_prompt_and_grows_with_the_reply_not_by_max_tokens(tiny_engine):
    """Four long prompts asking for max_tokens 1500 once held every slot at 2048 positions from
    admission on (a real server peaked past 2 GB on replies that stopped after a few tokens); the
    cache holds what is written and grows a granule at a time."""
    scheduler = BatchScheduler(tiny_engine.model, max_batch=4)
    prompt = tiny_engine.encode("word " * 400)[:300]
    sampling = SamplingParams(max_tokens=1500)
    try:
        requests = []
        for _ in range(4):
            seq = new_sequence(SequenceRequest(prompt, sampling, SpecConfig(method="off")),
                               Target(scheduler.cache, tiny_engine.tokenizer, frozenset(), tiny_engine.context_length),
                               slot=-1)
            requests.append(scheduler.submit(seq))
        for request in requests:
            next(e for e in scheduler.events(request) if e.token_ids)  # each has started its reply
            assert scheduler.cache.max_len == 512
            request.cancel.set()
    finally:
        scheduler.close()


@pytest.mark.parametrize("spec", [SpecConfig(method="off"), SpecConfig(method="ngram", gamma=4)])
def test_a_reply_past_the_first_granule_grows_the_cache_and_matches_serial_decoding(tiny_engine, spec):
    prompt = tiny_engine.encode("one two three four " * 200)[:500]
    sampling = SamplingParams(max_tokens=600)
    serial = new_sequence(SequenceRequest(prompt, sampling, SpecConfig(method="off")),
                          Target(tiny_engine.model.new_cache(1, 1200), tiny_engine.tokenizer, frozenset(),
                                 tiny_engine.context_length))
    from openalice_runner.engine.generator import run_sequence

    want = [e.result for e in run_sequence(tiny_engine.model, serial) if e.result is not None][0].token_ids
    scheduler = BatchScheduler(tiny_engine.model, max_batch=2)
    try:
        drafter = tiny_engine._make_drafter(spec, 1200, own_cache=True) if spec.method != "off" else None
        seq = new_sequence(SequenceRequest(prompt, sampling, spec, drafter),
                           Target(scheduler.cache, tiny_engine.tokenizer, frozenset(), tiny_engine.context_length),
                           slot=-1)
        got = _drain(scheduler, scheduler.submit(seq)).token_ids
        assert scheduler.cache.max_len == 1536  # 500 + 600 tokens and a round, in granules of 512
    finally:
        scheduler.close()
    assert len(want) == 600 and got == want
