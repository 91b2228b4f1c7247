"""Policy schema and loader: every rule field, and each error reported at its line and column."""

from __future__ import annotations

import contextlib
import textwrap

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openalice_runner.engine.types import SpecConfig
from openalice_runner.policies import PolicyError, PolicyStore, RequestContext, load_policy_text


def load(text: str):
    return load_policy_text(textwrap.dedent(text), "p.yaml")


def problems(text: str) -> list[str]:
    with pytest.raises(PolicyError) as info:
        load(text)
    return [str(p) for p in info.value.problems]


def store(text: str) -> PolicyStore:
    return PolicyStore.from_text(textwrap.dedent(text), "p.yaml")


def test_every_rule_field_decides():
    s = store("""\
        rules:
          - name: by-turn
            match: {turn_type: tool_call}
            method: ngram
            gamma: 5
            options: {ngram_min: 2, ngram_max: 3}
          - name: by-turn-list-and-batch
            match: {turn_type: [code_edit, rag], batch_size: {min: 2, max: 4}}
            method: ngram
            gamma: 3
          - name: by-provider
            match: {turn_type: chat, provider: [sg1, sg2]}
            method: eagle
            gamma: 4
            pool: e3
          - name: by-model
            match: {turn_type: reasoning, model: tiny}
            method: draft
            gamma: 2
            options: {draft_layers: 2}
          - name: eagle-head
            match: {turn_type: reasoning, model: big}
            method: eagle
            gamma: 6
            options: {eagle_head: /heads/big, eagle_lookup: true, eagle_tree: 8, ngram_min: 2}
          - name: unbounded-batch
            match: {turn_type: summarize, batch_size: {min: 9}}
            method: off
        default: {method: ngram, gamma: 1}
        """)
    d = s.decide(RequestContext("tool_call", 1))
    assert (d.method, d.gamma, d.rule, d.options) == ("ngram", 5, "by-turn", {"ngram_min": 2, "ngram_max": 3})
    spec = SpecConfig.from_plan(d)
    assert (spec.method, spec.gamma, spec.ngram_min, spec.ngram_max) == ("ngram", 5, 2, 3)
    assert s.decide(RequestContext("rag", 3)).rule == "by-turn-list-and-batch"
    assert s.decide(RequestContext("rag", 5)).rule == "default"  # outside the batch range
    d = s.decide(RequestContext("chat", 1, provider="sg2"))
    assert (d.method, d.gamma, d.pool) == ("eagle", 4, "e3")
    assert SpecConfig.from_plan(s.decide(RequestContext("reasoning", 1, model="tiny"))).draft_layers == 2
    spec = SpecConfig.from_plan(s.decide(RequestContext("reasoning", 1, model="big")))
    assert (spec.eagle_head, spec.eagle_lookup, spec.eagle_tree, spec.ngram_min) == ("/heads/big", True, 8, 2)
    assert s.decide(RequestContext("reasoning", 1, model=None)).rule == "default"
    d = s.decide(RequestContext("summarize", 9))
    assert (d.method, d.gamma, d.rule) == ("off", 0, "unbounded-batch")
    assert SpecConfig.from_plan(d).method == "off"
    d = s.decide(RequestContext("chat", 1))
    assert (d.rule, d.method, d.gamma) == ("default", "ngram", 1)
    assert d.policy_version == s.version and len(s.version) == 12
    assert "default" in d.reason


def test_yaml12_booleans_keep_off_a_string():
    assert load("default: {method: off}\n").policy.default.method == "off"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "default:\n  method: off\n  gama: 3\n",
            "p.yaml:3:3: unknown key 'gama' in default (did you mean 'gamma'?)",
        ),
        (
            "rules:\n  - name: a\n    match: {turn_type: chat}\n    method: ngram\n    gamma: five\n",
            "p.yaml:5:12: rules[0].gamma: input should be a valid integer or input should be 'auto', got 'five'",
        ),
        ("rules: []\n", "p.yaml:1:1: (top level): missing required key 'default'"),
        (
            "default: {method: fast}\n",
            "p.yaml:1:19: default.method: input should be 'off', 'ngram', 'draft', 'eagle' or 'suffix', got 'fast'",
        ),
        (
            "default: {method: ngram, gamma: 65}\n",
            "p.yaml:1:33: default.gamma: input should be less than or equal to 64",
        ),
        (
            "default: {method: ngram, gamma: 4}\ndefault: {method: off}\n",
            "p.yaml:2:1: duplicate key 'default'",
        ),
        ("default: [method\n", "p.yaml:2:1: YAML syntax"),
        ("", "p.yaml:1:1: file is empty"),
        ("- a\n", "p.yaml:1:1: a policy file must be a mapping"),
        ("default: {method: ngram}\n", "p.yaml:1:10: method ngram needs gamma"),
        ("default: {method: off, gamma: 2}\n", "p.yaml:1:31: gamma must be omitted"),
        (
            "default: {method: ngram, gamma: 3, max_gamma: 5}\n",
            "p.yaml:1:47: max_gamma only applies with gamma: auto",
        ),
        (
            "default: {method: ngram, gamma: auto, min_gamma: 6, max_gamma: 2}\n",
            "p.yaml:1:64: max_gamma 2 < min_gamma 6",
        ),
        (
            "default: {method: ngram, gamma: 3, options: {eagle_head: x}}\n",
            "p.yaml:1:46: option eagle_head does not apply to method ngram",
        ),
        (
            "default: {method: ngram, gamma: 3, options: {eagle_lookup: true}}\n",
            "p.yaml:1:46: option eagle_lookup does not apply to method ngram",
        ),
        (
            "default: {method: eagle, gamma: 3, options: {eagle_head: h, eagle_lookup: 2}}\n",
            "p.yaml:1:75: default.options.eagle_lookup: input should be a valid boolean",
        ),
        (
            "default: {method: eagle, gamma: 3, options: {eagle_head: h, eagle_tree: 1}}\n",
            "p.yaml:1:73: eagle_tree is 0 (chains) or a tree of 2 to 63 tokens, got 1",
        ),
        (
            "default: {method: eagle, gamma: 3, options: {eagle_head: h, eagle_tree: 64}}\n",
            "p.yaml:1:73: default.options.eagle_tree: input should be less than or equal to 63",
        ),
        (
            "default: {method: eagle, gamma: auto, options: {eagle_head: h, eagle_tree: 8}}\n",
            "p.yaml:1:76: eagle_tree needs a fixed gamma (its depth cap), not gamma: auto",
        ),
        (
            "default: {method: ngram, gamma: 3, options: {eagle_tree: 8}}\n",
            "p.yaml:1:46: option eagle_tree does not apply to method ngram",
        ),
        ("default: {method: eagle, gamma: 3}\n", "p.yaml:1:10: method eagle needs options.eagle_head"),
        ("default: {method: draft, gamma: 3}\n", "p.yaml:1:10: method draft needs options.draft_layers"),
        (  # the engine refuses a separate draft model: so does the check, at the option's key
            "default: {method: draft, gamma: 3, options: {draft_model: /models/small}}\n",
            "p.yaml:1:46: options.draft_model: the embedded engine has no separate draft models",
        ),
        (  # pools are the routing file's now (tests/providers/test_config.py checks them there)
            "version: 1\npools: {e: {algorithm: EAGLE3}}\ndefault: {method: off}\n",
            "p.yaml:2:1: `pools:` moved to the routing file: each pool's replicas and launch settings sit "
            "under providers.NAME.pools.POOL",
        ),
        (
            "rules:\n  - name: a\n    match: {}\n    method: off\ndefault: {method: off}\n",
            "p.yaml:3:12: match has no conditions",
        ),
        (
            "rules:\n  - name: a\n    match: {batch_size: {min: 5, max: 2}}\n    method: off\ndefault: {method: off}\n",
            "p.yaml:3:39: batch_size: max 2 < min 5",
        ),
        (
            "rules:\n  - name: a\n    match: {turn_type: chat}\n    method: off\n"
            "  - name: a\n    match: {turn_type: rag}\n    method: off\ndefault: {method: ngram, gamma: 2}\n",
            "p.yaml:5:11: duplicate rule name 'a'",
        ),
        (
            "rules:\n  - name: a\n    match: {turn_type: chat, batch_size: {max: 4}}\n    method: ngram\n    gamma: 3\n"
            "  - name: b\n    match: {turn_type: chat, batch_size: {min: 2, max: 3}}\n    method: off\n"
            "default: {method: off}\n",
            "p.yaml:7:12: rule 'b' is unreachable: earlier rules 'a' (line 2)",
        ),
        (
            "rules:\n  - name: a\n    match: {turn_type: [chat, rag]}\n    method: ngram\n    gamma: 3\n"
            "  - name: b\n    match: {batch_size: {min: 8}}\n    method: off\n"
            "default: {method: off}\n",
            "p.yaml:7:12: rule 'b' overlaps earlier rule 'a' (line 2) on turn_type=chat|rag, batch_size=8..",
        ),
    ],
)
def test_errors_name_line_and_column(text: str, expected: str):
    found = problems(text)
    assert any(p.startswith(expected) for p in found), found


def test_unreachable_by_union_of_earlier_rules():
    found = problems("""\
        rules:
          - name: small
            match: {batch_size: {max: 4}}
            method: off
          - name: big
            match: {batch_size: {min: 5}}
            method: off
          - name: chat
            match: {turn_type: chat}
            method: off
        default: {method: ngram, gamma: 2}
        """)
    assert found == [
        "p.yaml:9:12: rule 'chat' is unreachable: earlier rules 'small' (line 2), 'big' (line 5) already match everything it matches"
    ]


def test_exception_before_general_rule_is_allowed_and_same_decision_overlap_is_fine():
    s = store("""\
        rules:
          - name: tool-small
            match: {turn_type: tool_call, batch_size: {max: 4}}
            method: ngram
            gamma: 6
          - name: small
            match: {batch_size: {max: 4}}
            method: ngram
            gamma: 2
          - name: rag
            match: {turn_type: [rag, code_edit], batch_size: {min: 5}}
            method: off
          - name: big
            match: {batch_size: {min: 5}}
            method: off
        default: {method: off}
        """)
    assert s.decide(RequestContext("tool_call", 2)).gamma == 6
    assert s.decide(RequestContext("chat", 2)).gamma == 2
    assert s.decide(RequestContext("rag", 9)).rule == "rag"


def test_all_problems_reported_together_sorted_by_position():
    found = problems("""\
        rules:
          - name: a
            match: {turn_type: chat}
            method: ngram
            gamma: 3
            options: {ngram_min: 5, ngram_max: 2}
        default: {method: eagle, gamma: 2}
        """)
    assert [p.split(": ")[0] for p in found] == ["p.yaml:6:40", "p.yaml:7:10"]


def test_shipped_policies_load():
    for path in ("policies/default.yaml", "policies/gpu-sglang.yaml"):
        s = PolicyStore.from_file(path)
        assert s.policy.rules
        for turn in ("chat", "reasoning", "tool_call", "code_edit", "summarize", "rag", "custom"):
            for batch in (1, 4, 5, 16, 17, 33, 1000):
                d = s.decide(RequestContext(turn, batch, "local"))
                assert d.method in ("off", "ngram", "draft", "eagle")


def test_default_policy_shape():
    s = PolicyStore.from_file("policies/default.yaml")
    for turn in ("tool_call", "code_edit", "summarize", "rag"):
        assert s.decide(RequestContext(turn, 1, "local")).method == "ngram"
    d = s.decide(RequestContext("chat", 1, "gpu"))  # the SGLang provider of providers/gpu-example.yaml
    assert (d.method, d.pool) == ("eagle", "eagle3")
    assert s.decide(RequestContext("chat", 1, "local")).method == "ngram"
    small = s.policy.rules[0].gamma_bounds[1]
    mid = s.policy.rules[1].gamma_bounds[1]
    assert small > mid  # γ capped as the batch grows
    for turn in ("chat", "tool_call", "rag"):
        assert s.decide(RequestContext(turn, 64, "local")).method == "off"


# ---- property tests: random policies either load or raise PolicyError, never anything else ----

names = st.sampled_from(["chat", "reasoning", "tool_call", "rag", "x", "", 3, None])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 70), st.floats(allow_nan=True), names)
matches = st.fixed_dictionaries(
    {},
    optional={
        "turn_type": st.one_of(names, st.lists(names, max_size=3)),
        "batch_size": st.one_of(
            scalars,
            st.fixed_dictionaries({}, optional={"min": st.integers(-1, 40), "max": st.integers(-1, 40)}),
        ),
        "provider": st.one_of(names, st.lists(st.sampled_from(["local", "e"]), max_size=2)),
        "model": names,
        "bogus": scalars,
    },
)
decisions = st.fixed_dictionaries(
    {"method": st.sampled_from(["off", "ngram", "draft", "eagle", "fast", None])},
    optional={
        "gamma": st.one_of(st.integers(-1, 70), st.just("auto"), scalars),
        "min_gamma": st.integers(0, 10),
        "max_gamma": st.integers(0, 10),
        "prior_alpha": st.floats(-0.5, 1.5),
        "pool": st.sampled_from(["e", "n", "zz"]),
        "options": st.fixed_dictionaries(
            {},
            optional={
                "ngram_min": st.integers(0, 5),
                "ngram_max": st.integers(0, 5),
                "eagle_head": st.just("h"),
                "eagle_lookup": st.one_of(st.booleans(), st.just("yes")),
                "eagle_tree": st.integers(-1, 65),
                "draft_layers": st.integers(0, 3),
            },
        ),
    },
)
rules = st.builds(
    lambda name, m, d: {"name": name, "match": m, **d},
    st.sampled_from(["a", "b", "c", ""]),
    matches,
    decisions,
)
pools = st.dictionaries(
    st.sampled_from(["e", "n"]),
    st.fixed_dictionaries(
        {"algorithm": st.sampled_from(["EAGLE3", "NGRAM", "NONE", "X"])},
        optional={
            "draft_model_path": st.just("h"),
            "adaptive": st.booleans(),
            "eagle_topk": st.integers(0, 3),
            "num_steps": st.integers(0, 8),
        },
    ),
    max_size=2,
)
policies = st.fixed_dictionaries(
    {"rules": st.lists(rules, max_size=5)},
    optional={"default": decisions, "pools": pools, "version": st.sampled_from([1, 2])},
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policies)
def test_random_policies_load_or_raise_policy_error(data):
    text = yaml.safe_dump(data, sort_keys=False)
    try:
        loaded = load_policy_text(text, "h.yaml")
    except PolicyError as exc:
        assert exc.problems and all(p.line >= 1 and p.column >= 1 for p in exc.problems)
        return
    s = PolicyStore.from_text(text)
    for turn in ("chat", "rag", "x"):
        for batch in (1, 7, 40):
            d = s.decide(RequestContext(turn, batch, "local"))
            assert d.policy_version == loaded.version
            d.to_dict()


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=200))
def test_random_text_never_crashes_the_loader(text):
    with contextlib.suppress(PolicyError):
        load_policy_text(text, "t.yaml")
