"""Greedy speculative output equals plain output token for token (fp32).

Drafters: an all-accept oracle (proposes the plain run's own continuation), an all-reject
one (proposes tokens the target never picks), n-gram and the self-draft.
"""

from __future__ import annotations

import pytest
from stand_ins.drafters import OracleDrafter

from openalice_runner.engine import SamplingParams, SpecConfig


def check_all_drafters(engine, prompt: list[int], max_tokens: int, gammas=(1, 3, 5, 8),
                       must_accept=("ngram", "draft")):
    """Equality for every drafter and γ, each having drafted: an equality where nothing was
    proposed (or nothing accepted) says nothing about verification. The oracles draft every round
    (all accepted, none accepted); n-gram and the self-draft must propose over the γs, and those in
    `must_accept` have some accepted (the real model's story repeats nothing its n-grams guess right:
    10 and 11 proposed, none accepted, on 2026-12-04)."""
    sampling = SamplingParams(max_tokens=max_tokens)
    plain = engine.generate(prompt, sampling, SpecConfig(method="off"))
    assert plain.stats.target_passes == max(0, plain.stats.completion_tokens - 1) or plain.finish_reason == "stop"
    assert len(plain.token_ids) > 1, "a one-token reply leaves nothing to draft"
    vocab = engine.model.cfg.vocab_size
    drafted = {"ngram": [0, 0], "draft": [0, 0]}  # method: [proposed, accepted] over the γs
    for gamma in gammas:
        spec = SpecConfig(method="draft", gamma=gamma)
        accept_all = engine.generate(prompt, sampling, spec,
                                     drafter=OracleDrafter(len(prompt), plain.token_ids, vocab, True))
        assert accept_all.token_ids == plain.token_ids
        assert accept_all.stats.proposed > 0, ("the all-accept oracle drafted nothing", gamma)
        assert accept_all.stats.accepted == accept_all.stats.proposed and accept_all.stats.acceptance_rate == 1.0
        reject_all = engine.generate(prompt, sampling, spec,
                                     drafter=OracleDrafter(len(prompt), plain.token_ids, vocab, False))
        assert reject_all.token_ids == plain.token_ids
        assert reject_all.stats.proposed > 0, ("the all-reject oracle drafted nothing", gamma)
        assert reject_all.stats.accepted == 0
        for method in ("ngram", "draft"):
            out = engine.generate(prompt, sampling, SpecConfig(method=method, gamma=gamma))
            assert out.token_ids == plain.token_ids, (method, gamma)
            assert out.text == plain.text
            drafted[method][0] += out.stats.proposed
            drafted[method][1] += out.stats.accepted
    assert all(proposed > 0 for proposed, _ in drafted.values()), drafted
    assert all(drafted[method][1] > 0 for method in must_accept), drafted
    return plain


def test_greedy_equality_tiny_model(tiny_engine):
    for text in ("The quick brown fox jumps over the lazy dog. The quick brown fox", "def f(x):\n    return x"):
        prompt = tiny_engine.encode(text)
        check_all_drafters(tiny_engine, prompt, max_tokens=40)


def test_all_accept_uses_fewer_passes(tiny_engine):
    prompt = tiny_engine.encode("one two three four")
    sampling = SamplingParams(max_tokens=30)
    plain = tiny_engine.generate(prompt, sampling)
    fast = tiny_engine.generate(prompt, sampling, SpecConfig(method="draft", gamma=5),
                                drafter=OracleDrafter(len(prompt), plain.token_ids, 10, True))
    assert fast.token_ids == plain.token_ids
    # 30 tokens: 1 from prefill, then rounds of 6 -> 5 passes
    assert fast.stats.target_passes == 5
    assert fast.stats.accept_length_histogram[-1] == fast.stats.target_passes - (1 if 29 % 6 else 0)


@pytest.mark.slow
def test_greedy_equality_real_model(real_engine_fp32):
    engine = real_engine_fp32
    prompt = engine.render_chat([{"role": "user", "content": "Write a short story about a cat who learns to fly."}])
    plain = check_all_drafters(engine, prompt, max_tokens=48, gammas=(1, 5), must_accept=("draft",))
    assert plain.stats.completion_tokens > 5


def test_transformers_fallback_path_for_other_architectures(tiny_engine):
    # A GPT-2 layout is not Llama-family: the engine runs transformers' own forward with a
    # cropped DynamicCache, and greedy n-gram output still equals plain output and HF generate.
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from openalice_runner.engine import Engine
    from openalice_runner.engine.hf_model import HFCausalModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=tiny_engine.model.cfg.vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=256,
                        bos_token_id=1, eos_token_id=2)
    engine = Engine(GPT2LMHeadModel(config).eval(), tiny_engine.tokenizer, "tiny-gpt2", "fp32")
    assert isinstance(engine.model, HFCausalModel)
    prompt = engine.encode("red green blue red green blue red green")
    plain = engine.generate(prompt, SamplingParams(max_tokens=30))
    ngram = engine.generate(prompt, SamplingParams(max_tokens=30), SpecConfig(method="ngram", gamma=4))
    assert ngram.token_ids == plain.token_ids
    ids = torch.tensor([prompt])
    ref = engine.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
                                   eos_token_id=sorted(engine.eos_token_ids), pad_token_id=0)
    assert ref[0, len(prompt):].tolist()[: len(plain.token_ids)] == plain.token_ids


class ProbingDrafter(OracleDrafter):
    """The oracle, with every other round's draft marked as a probe."""

    rounds = 0

    def propose(self, history, gamma, sampling, generator):
        proposal = super().propose(history, gamma, sampling, generator)
        self.rounds += 1
        proposal.probe = self.rounds % 2 == 0
        return proposal


def test_probes_are_counted_apart(tiny_engine):
    prompt = tiny_engine.encode("one two three four")
    sampling = SamplingParams(max_tokens=30)
    plain = tiny_engine.generate(prompt, sampling, SpecConfig(method="off"))
    drafter = ProbingDrafter(len(prompt), plain.token_ids, tiny_engine.model.cfg.vocab_size, True)
    out = tiny_engine.generate(prompt, sampling, SpecConfig(method="draft", gamma=3), drafter=drafter)
    assert out.token_ids == plain.token_ids
    stats = out.stats
    assert 0 < stats.probe_proposed < stats.proposed
    assert stats.probe_accepted == stats.probe_proposed  # the oracle is always right
