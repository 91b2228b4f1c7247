"""EAGLE-style draft head: training on a tiny model, reload, target checks, lossless greedy output.

The exactness of sampled drafting with the eagle drafter is tested in engine/grammar/test_sampling_exact.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from stand_ins.eagle_heads import build_tiny_head

from openalice_runner.engine import SamplingParams, SpecConfig
from openalice_runner.engine.eagle.head import EagleHead, load_head
from openalice_runner.training.data import builtin_prompts, exclude_prompts, read_prompts
from openalice_runner.training.pipeline import BuildSettings, build_head
from openalice_runner.training.train import Trainer, TrainSettings


def assert_eagle_equals_off(engine, folder: Path) -> None:
    """Greedy eagle output equals `off`: γ 1, 3 and 5 drafted every round, and drafts sized by
    the head's confidence and the engine's pass costs (the default)."""
    for text in ("The quick brown fox jumps over the lazy dog. The quick brown fox", "def f(x):\n    return x"):
        prompt = engine.encode(text)
        plain = engine.generate(prompt, SamplingParams(max_tokens=40))
        for gamma in (1, 3, 5):
            out = engine.generate(prompt, SamplingParams(max_tokens=40),
                                  SpecConfig(method="eagle", gamma=gamma, eagle_head=str(folder), adaptive_length=False))
            assert out.token_ids == plain.token_ids, gamma
            assert out.stats.method == "eagle" and out.stats.proposed > 0
        out = engine.generate(prompt, SamplingParams(max_tokens=40),
                              SpecConfig(method="eagle", gamma=8, eagle_head=str(folder)))
        assert out.token_ids == plain.token_ids
        for adaptive in (False, True):  # prompt lookup first, the head elsewhere
            out = engine.generate(prompt, SamplingParams(max_tokens=40),
                                  SpecConfig(method="eagle", gamma=4, eagle_head=str(folder), eagle_lookup=True,
                                             adaptive_length=adaptive))
            assert out.token_ids == plain.token_ids, adaptive
        for nodes, adaptive, lookup in ((4, False, False), (12, False, False), (8, True, False), (8, True, True)):
            # draft trees: the head's top candidates at each depth, verified in one pass
            out = engine.generate(prompt, SamplingParams(max_tokens=40),
                                  SpecConfig(method="eagle", gamma=4, eagle_head=str(folder), eagle_tree=nodes,
                                             adaptive_length=adaptive, eagle_lookup=lookup))
            assert out.token_ids == plain.token_ids, (nodes, adaptive, lookup)
            if not adaptive:
                assert out.stats.proposed > out.stats.target_passes  # several tokens a round


@pytest.fixture(scope="module")
def tiny_head(tiny_engine, tmp_path_factory):
    """A head that reads f_t alone."""
    return build_tiny_head(tiny_engine, tmp_path_factory.mktemp("eagle"), None)


@pytest.fixture(scope="module")
def tiny_fused_head(tiny_engine, tmp_path_factory):
    """An EAGLE-3-style head: the target's low, middle and high layers fused with f_t."""
    return build_tiny_head(tiny_engine, tmp_path_factory.mktemp("eagle3"), "eagle3")


def test_tapped_layers_are_the_residual_stream(tiny_engine):
    """Taps leave the hidden state alone; the tap after the last layer, normed, is the hidden state."""
    model = tiny_engine.model
    last = model.cfg.n_layers - 1
    tokens = torch.tensor(tiny_engine.encode("one two three four five six"))
    n = len(tokens)
    plain = model.forward_rows(tokens, model.new_cache(1, 64), [0] * n, list(range(n)))
    hidden, tapped = model.forward_rows(tokens, model.new_cache(1, 64), [0] * n, list(range(n)), (0, last))
    assert torch.equal(hidden, plain)
    assert tapped.shape == (n, 2 * model.cfg.hidden)
    x = tapped[:, model.cfg.hidden :]
    torch.testing.assert_close(model._rms_norm(x, model.norm), hidden, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(tapped[:, : model.cfg.hidden], x)


def test_fused_head_trains_reloads_and_stays_exact(tiny_engine, tiny_fused_head):
    folder, figures, root = tiny_fused_head
    config = json.loads((folder / "config.json").read_text())
    layers = config["feature_layers"]
    assert layers == sorted(set(layers)) and len(layers) >= 2  # low .. high of a 4-layer target
    assert figures["loss"] < figures["first_loss"]
    head = load_head(folder, tiny_engine.model_name, tiny_engine.model)
    assert head.fuse is not None and head.fuse.in_features == (len(layers) + 1) * tiny_engine.model.cfg.hidden
    sample = next(iter((root / "data").glob("*.safetensors")))
    from safetensors.torch import load_file

    assert load_file(str(sample))["feats"].shape[1] == head.fuse.in_features  # taps, then f_t
    assert_eagle_equals_off(tiny_engine, folder)


def test_fused_and_plain_heads_share_a_batch(tiny_engine, tiny_head, tiny_fused_head):
    """One pass taps layers for the fused head's rows; every request (lookup-first ones too) still
    equals its `off` output."""
    from stand_ins.engines import run_concurrently

    sampling = SamplingParams(max_tokens=32)
    prompts = [tiny_engine.encode(t) for t in ("one two three four one two", "def g(y):\n    return y", "a b c")]
    reference = [tiny_engine.generate(p, sampling) for p in prompts]
    specs = [SpecConfig(method="eagle", gamma=3, eagle_head=str(tiny_fused_head[0])),
             SpecConfig(method="eagle", gamma=2, eagle_head=str(tiny_head[0])),
             SpecConfig(method="eagle", gamma=4, eagle_head=str(tiny_fused_head[0]), eagle_lookup=True),
             SpecConfig(method="ngram", gamma=4)]
    jobs = [(p, sampling, spec, None) for p in prompts for spec in specs]
    results = run_concurrently(tiny_engine, jobs)
    for (prompt, _, spec, _), got in zip(jobs, results, strict=True):
        assert got.token_ids == reference[prompts.index(prompt)].token_ids, spec


def test_training_lowers_the_loss_and_the_head_reloads(tiny_engine, tiny_head):
    folder, figures, root = tiny_head
    assert (folder / "head.safetensors").is_file() and (folder / "config.json").is_file()
    config = json.loads((folder / "config.json").read_text())
    assert config["target"]["name"] == "tiny-random"
    assert config["trained"]["steps"] == 30
    head = load_head(folder, tiny_engine.model_name, tiny_engine.model)
    # the loss on a fixed window: lower for the trained head than for the untrained one
    from openalice_runner.training.data import SampleCache

    cache = SampleCache(root / "data")
    sample = cache.get(next(iter(sorted(p.stem for p in (root / "data").glob("*.safetensors")))))
    torch.manual_seed(0)
    fresh = EagleHead(head.cfg)
    fresh.init_from_target(tiny_engine.model)
    settings = TrainSettings()
    with torch.no_grad():
        window = Trainer(tiny_engine.model, fresh, settings)._window(sample, 256, start=0)
        before, _ = Trainer(tiny_engine.model, fresh.eval(), settings).losses(*window)
        after, _ = Trainer(tiny_engine.model, head, settings).losses(*window)
    assert float(after) < float(before)
    assert figures["loss"] < figures["first_loss"]


def test_head_for_another_target_is_an_error(tiny_head):
    from openalice_runner.engine import Engine

    folder, _, _ = tiny_head
    other = Engine.tiny_random(seed=1)
    with pytest.raises(ValueError, match="lm_head_sha256"):
        load_head(folder, other.model_name, other.model)
    with pytest.raises(ValueError, match="name"):
        load_head(folder, "SmolLM2-135M-Instruct", other.model)
    with pytest.raises(ValueError, match="another target"):
        other.generate(other.encode("hello"), SamplingParams(max_tokens=4),
                       SpecConfig(method="eagle", gamma=3, eagle_head=str(folder)))


def test_eagle_without_a_head_names_the_field(tiny_engine):
    with pytest.raises(ValueError, match="eagle_head"):
        tiny_engine.generate(tiny_engine.encode("hello"), SamplingParams(max_tokens=4), SpecConfig(method="eagle"))


def test_not_a_head_folder_is_an_error(tiny_engine, tmp_path):
    with pytest.raises(ValueError, match="not a trained head"):
        tiny_engine.generate(tiny_engine.encode("hello"), SamplingParams(max_tokens=4),
                             SpecConfig(method="eagle", eagle_head=str(tmp_path)))


def test_greedy_eagle_equals_off_tiny_model(tiny_engine, tiny_head):
    assert_eagle_equals_off(tiny_engine, tiny_head[0])


def test_greedy_eagle_equals_off_with_accepted_drafts(tiny_engine, tiny_head):
    """A runtime whose drafts are the target's own greedy tokens (all accepted): the catch-up and
    feature bookkeeping over accepted rounds must keep the output identical and use fewer passes."""
    from openalice_runner.engine.drafters.eagle import EagleDrafter
    from openalice_runner.engine.eagle.head import EagleRuntime

    folder, _, _ = tiny_head
    head = load_head(folder, tiny_engine.model_name, tiny_engine.model)
    prompt = tiny_engine.encode("one two three four five")
    plain = tiny_engine.generate(prompt, SamplingParams(max_tokens=30))
    reference = prompt + plain.token_ids

    class Oracle(EagleRuntime):
        """Real head passes (cache writes, positions), logits forced to the reference token."""

        def __init__(self, *a):
            super().__init__(*a)
            self.vocab = torch.arange(tiny_engine.model.cfg.vocab_size)
            self.pos = 0

        def step(self, cache, feats, next_tokens, positions):
            self.pos = positions[-1] + 2  # the predicted feature is that of the token at pos+1
            return super().step(cache, feats, next_tokens, positions)

        def logits(self, feats):
            out = torch.zeros(1, len(self.vocab))
            if self.pos < len(reference):
                out[0, reference[self.pos]] = 1.0
            return out

    rt = Oracle(head, tiny_engine.model)
    out = tiny_engine.generate(prompt, SamplingParams(max_tokens=30), SpecConfig(method="eagle", gamma=4),
                               drafter=EagleDrafter(rt, 256, tiny_engine.model.cfg.vocab_size))
    assert out.token_ids == plain.token_ids
    assert out.stats.acceptance_rate > 0.9
    assert out.stats.target_passes < plain.stats.target_passes // 2


def test_prefix_reuse_hands_the_head_its_features(tiny_engine, tiny_fused_head):
    """A follow-up call reuses the finished call's cache and its drafter's features and head
    cache: it prefills only the new tokens, still drafts, and still equals `off`."""
    from openalice_runner.engine import Engine

    engine = Engine.tiny_random(seed=0, max_batch=4, prefix_reuse=True)  # the weights of tiny_engine
    sampling = SamplingParams(max_tokens=24)
    first_prompt = engine.encode("one two three four one two three four one two")
    for lookup in (False, True):
        spec = SpecConfig(method="eagle", gamma=3, eagle_head=str(tiny_fused_head[0]), eagle_lookup=lookup,
                          adaptive_length=False)
        first = engine.generate(first_prompt, sampling, spec)
        prompt = first_prompt + first.token_ids + engine.encode(" five six")
        out = engine.generate(prompt, sampling, spec)
        assert out.stats.cached_prompt_tokens == len(first_prompt) + len(first.token_ids) - 1, lookup
        assert out.token_ids == tiny_engine.generate(prompt, sampling).token_ids
        # the head drafts as it would have after a full prefill: its state carried over intact
        full = tiny_engine.generate(prompt, sampling, spec)
        assert (out.stats.proposed, out.stats.accepted) == (
            full.stats.proposed, full.stats.accepted) and out.stats.proposed > 0
    # after an `off` request there are no features to take over: the prompt is prefilled in full
    engine.generate(prompt + [5], sampling)
    out = engine.generate(prompt + [5, 7], sampling, spec)
    assert out.stats.cached_prompt_tokens == 0 and out.token_ids == tiny_engine.generate(prompt + [5, 7], sampling).token_ids


def test_eagle_drafter_takes_over_a_prefix_exactly(tiny_engine, tiny_fused_head):
    """After `reuse`, a drafter that observed only the new positions holds the same head cache
    rows, proposes the same drafts and predicts the same features as one that observed them all."""
    from openalice_runner.engine.drafters.eagle import EagleDrafter

    rt = tiny_engine.eagle_runtime(str(tiny_fused_head[0]))
    vocab = tiny_engine.model.cfg.vocab_size
    torch.manual_seed(0)
    tokens = torch.randint(0, 500, (40,)).tolist()
    feats = torch.randn(40, rt.cfg.feature_width)
    greedy = SamplingParams()

    # the new sequence shares 25 tokens with the old one; its 26th differs
    new_tokens = tokens[:25] + [(tokens[25] + 1) % 500] + tokens[26:]

    def drafter(max_len: int, seq: list[int] = new_tokens) -> EagleDrafter:
        d = EagleDrafter(rt, max_len, vocab)
        d.start(seq)
        return d

    def finished() -> EagleDrafter:
        """A finished sequence's drafter: 30 positions fed, drafts proposed along the way."""
        old = drafter(64, tokens)
        old.observe(feats[:20])
        old.propose(tokens[:21], 3, greedy, None)
        old.observe(feats[20:30])
        old.propose(tokens[:31], 3, greedy, None)
        return old

    for max_len in (64, 128):  # sharing the old cache, and growing into a larger one of its own
        full = drafter(max_len)
        full.observe(feats[:36])
        reused = drafter(max_len)
        assert reused.reuse(finished(), 25)
        reused.observe(feats[25:36])
        want = full.propose(new_tokens[:37], 4, greedy, None).tokens
        assert reused.propose(new_tokens[:37], 4, greedy, None).tokens == want
        for mine, theirs in zip(reused.cache, full.cache, strict=True):
            assert torch.equal(mine[:, :, :36], theirs[:, :, :36])
    assert not drafter(64).reuse(finished(), 31)  # more positions than it fed


def test_lookup_first_drafts_copies_by_lookup_and_the_rest_by_the_head():
    """Rounds go to the lookup where the text has a match and to the head elsewhere; each
    verdict teaches only the drafter that drafted; the head sees every kept row."""
    from openalice_runner.engine.drafters.base import Drafter, Proposal
    from openalice_runner.engine.drafters.lookup_first import LookupFirstDrafter
    from openalice_runner.engine.drafters.ngram import NgramDrafter

    class Head(Drafter):
        wants_hidden = True
        feature_layers = (2,)

        def __init__(self):
            self.updates, self.observed = [], 0

        def propose(self, history, gamma, sampling, generator):
            return Proposal([7] * gamma)

        def observe(self, hidden):
            self.observed += hidden.shape[0]

        def update(self, history, proposed, accepted):
            self.updates.append((proposed, accepted))

    lookup, head = NgramDrafter(2, 2), Head()
    drafter = LookupFirstDrafter(lookup, head)
    assert drafter.wants_hidden and drafter.feature_layers == (2,)
    greedy = SamplingParams()
    drafter.start([1, 2, 3, 4, 1, 2])
    assert drafter.propose([1, 2, 3, 4, 1, 2], 2, greedy, None).tokens == [3, 4]  # copies
    two = lookup.acceptance.length_class(2)  # the class of a match of 2 (agreeing for 2)
    before = lookup.acceptance.accepted[two], lookup.acceptance.rejected[two]
    drafter.observe(torch.zeros(2, 4))
    drafter.update([1, 2, 3, 4, 1, 2, 3], 2, 1)
    assert head.updates == [] and head.observed == 2
    # the lookup learned: one accepted token and one rejection, for a match of 2
    assert (lookup.acceptance.accepted[two], lookup.acceptance.rejected[two]) == (before[0] + 1, before[1] + 1)
    assert drafter.propose([1, 2, 3, 4, 1, 2, 3, 9], 3, greedy, None).tokens == [7, 7, 7]  # no match
    drafter.update([1, 2, 3, 4, 1, 2, 3, 9, 5], 3, 0)
    assert head.updates == [(3, 0)] and drafter.rounds == {"lookup": 1, "head": 1}


def test_eagle_lookup_is_an_eagle_option():
    with pytest.raises(ValueError, match="eagle_lookup"):
        SpecConfig(method="ngram", eagle_lookup=True)
    assert SpecConfig(method="eagle", eagle_head="h", eagle_lookup=True).eagle_lookup


def test_prompts_exclude_the_benchmark(workload_path, tmp_path):
    bench = read_prompts([workload_path])
    generated = tmp_path / "p.jsonl"
    generated.write_text("".join(json.dumps(r) + "\n" for r in builtin_prompts(300, seed=0)))
    mine = read_prompts([generated])
    # the workload's own prompts are all dropped; the built-in set keeps (almost) everything
    assert exclude_prompts(bench, bench) == []
    assert len(exclude_prompts(mine, bench)) >= 0.95 * len(mine)
    texts = {m[-1]["content"] for m in bench}
    assert not texts & {m[-1]["content"] for m in mine}
    assert "textwrap" not in generated.read_text() and "fnmatch" not in generated.read_text()


@pytest.fixture(scope="module")
def real_head(real_engine_fp32, tmp_path_factory) -> Path:
    """A head for the default model: OPENALICE_EAGLE_HEAD, else the one `openalice-runner draft train`
    saves, else a tiny one trained here (30 steps on 24 built-in prompts, none of the workload's,
    24 tokens each; under a minute): the test below never skips for want of a head, in CI or anywhere."""
    from openalice_runner.training.pipeline import default_out

    given = os.environ.get("OPENALICE_EAGLE_HEAD")
    if given:
        assert (Path(given) / "config.json").is_file(), f"OPENALICE_EAGLE_HEAD={given} holds no head"
        return Path(given)
    trained = default_out(real_engine_fp32.model_name)
    if (trained / "config.json").is_file():
        return trained
    root = tmp_path_factory.mktemp("real-head")
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in builtin_prompts(24, seed=3)))
    # bounded by steps, not time (the budget is far off): the same head on every machine
    settings = BuildSettings(minutes=10.0, gen_minutes=8.0, max_new_tokens=24, draft_vocab=2048, heldout_every=6,
                             max_steps=30, progress=False, data_dir=root / "data")
    folder, _ = build_head(real_engine_fp32, [data], root / "head", settings=settings)
    return folder


@pytest.mark.slow
def test_greedy_eagle_equals_off_real_model_fp32(real_engine_fp32, real_head, workload_path):
    """Every workload case, fp32: eagle output identical to off, with fixed, confidence-sized and
    lookup-first drafts, fixed trees and eagle-local.yaml's sized trees; the fixed drafts proposed
    in every case."""
    from openalice_runner.bench.workload import load_workload, render_case

    head = real_head
    engine = real_engine_fp32
    for case in load_workload(workload_path):
        prompt = render_case(engine, case)
        sampling = SamplingParams(max_tokens=case.max_tokens)
        plain = engine.generate(prompt, sampling)
        fixed = engine.generate(prompt, sampling, SpecConfig(method="eagle", gamma=4, eagle_head=str(head),
                                                             adaptive_length=False))
        assert fixed.token_ids == plain.token_ids, case.id
        assert fixed.stats.proposed > 0
        sized = engine.generate(prompt, sampling, SpecConfig(method="eagle", gamma=8, eagle_head=str(head)))
        assert sized.token_ids == plain.token_ids, case.id
        lookup = engine.generate(prompt, sampling, SpecConfig(method="eagle", gamma=5, eagle_head=str(head),
                                                              eagle_lookup=True))
        assert lookup.token_ids == plain.token_ids, case.id
        tree = engine.generate(prompt, sampling, SpecConfig(method="eagle", gamma=5, eagle_head=str(head),
                                                            eagle_tree=8, adaptive_length=False))
        assert tree.token_ids == plain.token_ids, case.id  # fixed 8-token trees, every round
        shipped = engine.generate(prompt, sampling, SpecConfig(method="eagle", gamma=5, eagle_head=str(head),
                                                               eagle_lookup=True, eagle_tree=16))
        assert shipped.token_ids == plain.token_ids, case.id  # eagle-local.yaml's: lookup, sized 16-token trees


def _costs(per_row: float):
    from openalice_runner.engine.cost_model import PassCostModel

    costs = PassCostModel()
    for rows in range(1, 10):
        costs.record(rows, 0.02 * (1 + per_row * (rows - 1)))
    return costs


def test_draft_length_follows_confidence_and_costs():
    """Sure drafts on cheap verify rows run to the cap; unsure ones on dear rows are not proposed."""
    from openalice_runner.engine.drafters.eagle import _DraftLength

    sure = _DraftLength(_costs(0.05), step_s=0.001, batch=1, rows=1)
    assert all(sure.worth_another(0.95) for _ in range(6)) and sure.best == 6
    unsure = _DraftLength(_costs(0.5), step_s=0.004, batch=1, rows=1)
    assert not unsure.worth_another(0.3) and unsure.best == 0
    # confidence falling along the chain: stop where the next draft no longer pays
    falling = _DraftLength(_costs(0.1), step_s=0.001, batch=1, rows=1)
    steps = [falling.worth_another(c) for c in (0.95, 0.9, 0.4, 0.2)]
    assert steps[:2] == [True, True] and not all(steps) and 2 <= falling.best <= 3
    # in a batch of 8 the same sure draft must beat 8 sequences' worth of tokens: shorter
    busy = _DraftLength(_costs(0.05), step_s=0.001, batch=8, rows=8)
    while busy.worth_another(0.95):
        pass
    assert busy.best < 6
    # nothing timed yet: the drafter drafts γ, so verify passes get measured
    from openalice_runner.engine.cost_model import PassCostModel

    assert not _DraftLength(PassCostModel(), None, 1, 1).active


def test_feature_layers_option():
    import argparse

    from openalice_runner.cli.draft import feature_layers

    assert feature_layers("eagle3") == "eagle3" and feature_layers("None") is None
    assert feature_layers("27, 2,15") == [2, 15, 27]
    for bad in ("2,a", "-1", ","):
        with pytest.raises(argparse.ArgumentTypeError, match="layer indices"):
            feature_layers(bad)
    # a layer beyond the target is a ValueError naming the field, before any distilling
    from openalice_runner.engine import Engine

    tiny = Engine.tiny_random(seed=0)
    with pytest.raises(ValueError, match="feature_layers"):
        build_head(tiny, [], settings=BuildSettings(feature_layers=[99], progress=False))


def test_train_step_options(capsys):
    from openalice_runner.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["draft", "train", "--data", "p.jsonl"])
    assert (args.tokens_per_step, args.lr) == (256, 1e-3)  # the defaults BuildSettings has
    assert (BuildSettings().tokens_per_step, BuildSettings().lr) == (256, 1e-3)
    args = parser.parse_args(["draft", "train", "--data", "p.jsonl", "--tokens-per-step", "1024", "--lr", "3e-3"])
    assert (args.tokens_per_step, args.lr) == (1024, 3e-3)
    for flag, bad, said in [("--tokens-per-step", "0", "must be >= 1"), ("--lr", "0", "must be a finite number > 0"),
                            ("--lr", "nan", "must be a finite number > 0"), ("--lr", "inf", "must be a finite number > 0"),
                            ("--lr", "fast", "is not a number")]:
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["draft", "train", "--data", "p.jsonl", flag, bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert flag in err and said in err, err


def test_training_runs_on_the_threads_the_engine_left_torch(tmp_path, monkeypatch):
    """The engine leaves torch one thread for its passes (its kernels have their own workers);
    training is torch's work alone, so it runs on the threads torch had before, and torch gets its
    one thread back afterwards (where the engine goes on serving)."""
    import openalice_runner.training.pipeline as pipeline
    from openalice_runner.engine import Engine

    engine = Engine.tiny_random(seed=0)
    monkeypatch.setattr(engine, "torch_threads", 2)
    seen = []
    real = pipeline.train_head

    def train_head(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "train_head", train_head)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = tmp_path / "prompts.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in builtin_prompts(4, seed=3)))
        settings = BuildSettings(minutes=1.0, max_new_tokens=4, draft_vocab=64, max_steps=2, progress=False,
                                 data_dir=tmp_path / "data")
        _, figures = build_head(engine, [data], tmp_path / "head", settings=settings)
        assert seen == [2] and figures["train_threads"] == 2
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_training_windows_hold_the_reply_and_acceptance_counts_reply_rows(tiny_engine, tiny_head):
    from openalice_runner.training.data import Sample

    folder, _, _ = tiny_head
    head = load_head(folder, tiny_engine.model_name, tiny_engine.model)
    width = head.cfg.feature_width
    torch.manual_seed(0)
    length, prompt_len = 300, 200
    sample = Sample("s", torch.randint(0, tiny_engine.model.cfg.vocab_size, (length + 1,)),
                    torch.randn(length, width).to(torch.bfloat16), prompt_len)
    trainer = Trainer(tiny_engine.model, head, TrainSettings())
    # a window shorter than the sequence ends at its end: the whole reply, then prompt context
    feats, nxt, start, first = trainer._window(sample, 128)
    assert (start, feats.shape[0], nxt.shape[0]) == (length - 128, 128, 128)
    assert first == prompt_len - 1 - start
    # a reply longer than the window: a random window inside it, a quarter of it kept for context
    starts = {trainer._window(Sample("l", sample.tokens, sample.feats, 40), 64)[2] for _ in range(50)}
    assert len(starts) > 1 and min(starts) >= 40 - 1 - 64 // 4 and max(starts) <= length - 64
    # loss weights: 1 from the row before the reply's first token, prompt_weight before it
    weights = Trainer(tiny_engine.model, head, TrainSettings(prompt_weight=0.25)).row_weights(10, 4)
    assert weights.tolist() == [0.25] * 4 + [1.0] * 5
    loss, weight = Trainer(tiny_engine.model, head, TrainSettings(prompt_weight=0.0)).losses(feats, nxt, start, first)
    assert weight == feats.shape[0] - 1 - first and torch.isfinite(loss)
    # held-out acceptance counts reply rows only. Truth = the head's own first drafts: acc@1 1.0,
    # and still 1.0 with every prompt row's truth made wrong
    with torch.no_grad():
        out = head.forward_unrolled(sample.feats.float(), tiny_engine.model.embed[sample.tokens[1:]].float(), 1)[0]
    truth = torch.zeros(length, dtype=torch.long)
    truth[1:] = trainer.vocab[(out[:-1] @ trainer.lm_sub.t()).argmax(-1)]
    assert trainer.evaluate([sample], [truth])["acc1"] == 1.0
    scrambled = truth.clone()
    scrambled[:prompt_len] = -1
    assert trainer.evaluate([sample], [scrambled])["acc1"] == 1.0
    wrong = truth.clone()
    wrong[prompt_len:] = -1  # no draft can equal it
    assert trainer.evaluate([sample], [wrong])["acc1"] == 0.0
