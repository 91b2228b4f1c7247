"""γ by batch size: the batch pieces, the tables a decision carries, and SGLang's adaptive config
compiled from the same pieces. Torch-free: the policy never needs the engine."""

from __future__ import annotations

import textwrap

import pytest

from openalice_runner.policies import PolicyStore, RequestContext, load_policy_text
from openalice_runner.policies.batch_table import batch_segments
from openalice_runner.providers.pools.sglang.args import compile_pool
from openalice_runner.providers.pools.sglang.launch import SGLangLaunch
from openalice_runner.speculation import GammaTable, SpeculationPlan

INF = float("inf")


def test_batch_segments_cut_where_ranges_start_and_end():
    a, b, c = "a", "b", "c"
    pieces = batch_segments([(1, 4, a), (5, 16, b), (1, INF, c)])
    assert pieces == [(1, [a, c]), (5, [b, c]), (17, [c])]
    # a range starting above 1 leaves a piece nobody covers below it
    assert batch_segments([(3, 8, a)]) == [(1, []), (3, [a]), (9, [])]
    # neighbouring pieces with the same covering items merge
    assert batch_segments([(1, 4, a), (5, 8, a)]) == [(1, [a]), (9, [])]


def test_gamma_table_lookup_and_validation():
    t = GammaTable(((1, 6), (5, 3), (17, 0)))
    assert [t.at(n) for n in (0, 1, 4, 5, 16, 17, 1000)] == [6, 6, 6, 3, 3, 0, 0]
    assert t.to_dict() == {"1": 6, "5": 3, "17": 0}
    with pytest.raises(ValueError, match="start at batch size 1"):
        GammaTable(((2, 4),))
    with pytest.raises(ValueError, match="increase"):
        GammaTable(((1, 4), (1, 2)))
    with pytest.raises(ValueError, match=r"\[0, 64\]"):
        GammaTable(((1, 65),))
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculationPlan("fast", 3)  # type: ignore[arg-type]


POLICY = textwrap.dedent("""\
    rules:
      - name: copy-small
        match: {turn_type: code_edit, batch_size: {max: 4}}
        method: ngram
        gamma: 6
      - name: copy-mid
        match: {turn_type: code_edit, batch_size: {min: 5, max: 8}}
        method: ngram
        gamma: 2
      - name: chat
        match: {turn_type: chat}
        method: eagle
        gamma: 3
        options: {eagle_head: /heads/h}
    default: {method: off}
    """)


def test_a_decision_carries_its_methods_gamma_at_every_batch_size():
    store = PolicyStore.from_text(POLICY)
    d = store.decide(RequestContext("code_edit", 1, "local"))
    assert (d.method, d.gamma, d.rule) == ("ngram", 6, "copy-small")
    assert d.per_batch == GammaTable(((1, 6), (5, 2), (9, 0)))  # past 8: the default, off
    # decided at a mid batch: the same table (the batch may shrink again)
    assert store.decide(RequestContext("code_edit", 6, "local")).per_batch == d.per_batch
    # a rule with one γ at every batch size needs no table
    chat = store.decide(RequestContext("chat", 1, "local"))
    assert (chat.method, chat.gamma, chat.per_batch) == ("eagle", 3, None)
    # off carries none either
    assert store.decide(RequestContext("code_edit", 9, "local")).per_batch is None


def test_an_auto_rule_fills_its_pieces_from_the_estimates():
    store = PolicyStore.from_text(textwrap.dedent("""\
        rules:
          - name: small
            match: {batch_size: {max: 4}}
            method: ngram
            gamma: auto
            min_gamma: 3
            max_gamma: 8
            prior_alpha: 0.9
          - name: mid
            match: {batch_size: {min: 5, max: 8}}
            method: ngram
            gamma: auto
            min_gamma: 1
            max_gamma: 4
            prior_alpha: 0.9
        default: {method: off}
        """))
    d = store.decide(RequestContext("tool_call", 1, "local"))
    table = d.per_batch
    assert table is not None and table.at(1) == d.gamma >= 3
    assert 1 <= table.at(6) <= 4 and table.at(9) == 0


def test_sglang_adaptive_config_comes_from_the_same_pieces():
    pool = SGLangLaunch(algorithm="EAGLE3", draft_model_path="/h", adaptive=True, num_steps=3)
    policy = load_policy_text(textwrap.dedent("""\
        rules:
          - name: small
            match: {turn_type: chat, batch_size: {max: 8}}
            method: eagle
            gamma: 5
            pool: e
          - name: big
            match: {turn_type: chat, batch_size: {min: 9, max: 16}}
            method: eagle
            gamma: 3
            pool: e
          - name: other-turns
            match: {turn_type: reasoning, batch_size: {max: 12}}
            method: eagle
            gamma: 4
            pool: e
        default: {method: off}
        """), "p.yaml").policy
    cfg = compile_pool(pool, "e", policy, "/tmp/a.json").adaptive_config
    slots = {k: v["candidate_steps"] for k, v in cfg.items() if k.isdigit()}
    # 1-8: chat 5 and reasoning 4; 9-12: chat 3 and reasoning 4; 13-16: chat 3; past 16: none
    assert slots == {"1": [4, 5], "9": [3, 4], "13": [3]}
