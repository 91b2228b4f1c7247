"""Routing config: the shipped files load; mistakes are reported as FILE:LINE:COL."""

from __future__ import annotations

from pathlib import Path

import pytest
from locations import REPO

from openalice_runner.policies import PolicyStore, RequestContext
from openalice_runner.providers.config import (
    RoutingConfig,
    RoutingConfigError,
    load_routing_file,
    load_routing_text,
)


def sglang_routing(pools: str, default_pool: str | None = None) -> str:
    """A routing file with one SGLang provider `g` whose pools are given inline on line 6."""
    default = f"    default_pool: {default_pool}\n" if default_pool else ""
    return (
        f"providers:\n  g:\n    type: sglang\n    model: m\n    pools:\n      {pools}\n"
        f"{default}routes:\n  - {{name: d, chain: [g]}}\n"
    )


def test_shipped_files_load():
    assert load_routing_file(REPO / "providers/default.yaml") == RoutingConfig.default()
    gpu = load_routing_file(REPO / "providers/gpu-example.yaml")
    assert set(gpu.providers) == {"gpu", "cloud", "local"}
    eagle3 = gpu.providers["gpu"].pools["eagle3"]
    chat = PolicyStore.from_file(REPO / "policies/gpu-sglang.yaml").decide(RequestContext("chat", 1, "gpu"))
    assert eagle3.adaptive and eagle3.gamma_for(chat) == 7  # the most one round can draft for that rule
    assert gpu.providers["gpu"].pools["plain"].method == "off"  # algorithm NONE
    assert gpu.route_for("tool_call", None).name == "tool-steps"
    assert gpu.route_for("chat", "anything").name == "default"


def test_routes_match_turn_type_and_model_in_order():
    cfg = load_routing_text(
        """
providers:
  a: {type: local}
  b: {type: local, tiny_random: true}
routes:
  - name: big-model-tools
    match: {turn_types: [tool_call], models: [big]}
    chain: [b]
  - name: tools
    match: {turn_types: [tool_call]}
    chain: [a, b]
  - name: big
    match: {models: [big]}
    chain: [b, a]
"""
    )
    assert cfg.route_for("tool_call", "big").name == "big-model-tools"
    assert cfg.route_for("tool_call", None).name == "tools"
    assert cfg.route_for("chat", "big").name == "big"
    with pytest.raises(LookupError, match="catch-all"):
        cfg.route_for("chat", None)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "providers:\n  a: {type: local, dtyp: bf16}\nroutes:\n  - {name: d, chain: [a]}\n",
            "f.yaml:2:20: unknown key 'dtyp'",
        ),
        (
            "providers:\n  a: {type: local}\nroutes:\n  - name: d\n    chain: [a, nope]\n",
            "f.yaml:5:16: route 'd' names provider 'nope'",
        ),
        ("providers:\n  a: {type: lokal}\nroutes:\n  - {name: d, chain: [a]}\n", "f.yaml:2:6: providers.a"),
        ("providers:\n  a: {type: local}\n  a: {type: local}\nroutes: []\n", "f.yaml:3:3"),
        ("providers:\n  a: {type: local}\nroutes:\n  - {name: d, chain: [a]\n", "f.yaml:5:1: YAML syntax"),
        (
            "providers:\n  g:\n    type: sglang\n    model: m\n    pools:\n      p: {replicas: [ftp://x]}\nroutes:\n  - {name: d, chain: [g]}\n",
            "f.yaml:6:21: providers.g.pools.p.replicas",
        ),
        (
            "providers:\n  a: {type: local}\nroutes:\n  - {name: d, chain: [a]}\n  - {name: d, chain: [a]}\n",
            "f.yaml:5:12: duplicate route name",
        ),
        ("- just a list\n", "f.yaml:1:1: a routing file must be a mapping"),
        # an SGLang pool's launch settings, each problem at its key (they become the servers' flags)
        (sglang_routing("e: {replicas: [http://x], launch: {algorithm: EAGLE3}}"),
         "f.yaml:6:41: pool 'e': EAGLE3 pool needs draft_model_path"),
        (sglang_routing("n: {replicas: [http://x], launch: {algorithm: NGRAM, adaptive: true}}"),
         "f.yaml:6:70: pool 'n': SGLang's adaptive speculation supports EAGLE/EAGLE3 only"),
        (sglang_routing("e: {replicas: [http://x], launch: {algorithm: EAGLE, draft_model_path: h, adaptive: true, "
                        "eagle_topk: 4, max_running_requests: 8}}"),
         "f.yaml:6:109: pool 'e': SGLang's adaptive speculation needs eagle_topk 1"),
        (sglang_routing("e: {replicas: [http://x], launch: {algorithm: EAGLE, draft_model_path: h, num_steps: 3, "
                        "num_draft_tokens: 8}}"),
         "f.yaml:6:113: pool 'e': with eagle_topk 1 SGLang uses num_draft_tokens = num_steps + 1 = 4"),
        (sglang_routing("e: {replicas: [http://x], launch: {algorithm: EAGLE3, draft_model_path: h, adaptive: true}}"),
         "f.yaml:6:41: pool 'e': an adaptive pool needs max_running_requests"),
        (sglang_routing("p: {replicas: [http://x], launch: {algorithm: NONE, num_steps: 3}}"),
         "f.yaml:6:59: pool 'p': num_steps does not apply to a pool without speculation"),
        (sglang_routing("p: {replicas: [http://x], launch: {algrithm: NONE}}"),
         "f.yaml:6:42: unknown key 'algrithm'"),
    ],
)
def test_problems_carry_file_line_column(text, expected):
    with pytest.raises(RoutingConfigError) as info:
        load_routing_text(text, "f.yaml")
    assert expected in str(info.value), str(info.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(RoutingConfigError, match="cannot read"):
        load_routing_file(tmp_path / "nope.yaml")


# ---- cross-file: a policy's rules against the pools a routing file deploys ----

PARSED = "p: {replicas: [http://x], launch: {tool_call_parser: llama3}}"  # a default pool that passes


@pytest.mark.parametrize(
    ("policy", "pools", "expected"),
    [
        ("default: {method: off, pool: nope}\n", PARSED, "p.yaml:1:30: unknown pool 'nope': no SGLang or vLLM provider"),
        (  # the pool's algorithm decides which methods it serves
            "default: {method: eagle, gamma: 2, pool: n}\n",
            "{n: {replicas: [http://x], launch: {algorithm: NGRAM, tool_call_parser: llama3}}, " + PARSED + "}",
            "p.yaml:1:19: method eagle cannot be served by pool 'n' (NGRAM)",
        ),
        # SGLang parses tool calls only with --tool-call-parser: a pool serving tool_call turns needs one
        (
            "rules:\n  - name: t\n    match: {turn_type: [chat, tool_call]}\n"
            "    method: ngram\n    gamma: 3\n    pool: n\ndefault: {method: off}\n",
            "{n: {replicas: [http://x], launch: {algorithm: NGRAM}}, " + PARSED + "}",
            "p.yaml:6:11: pool 'n' serves tool_call turns but has no tool_call_parser",
        ),
        (  # the default decision serves every turn type
            "default: {method: off, pool: q}\n",
            "{q: {replicas: [http://x]}, " + PARSED + "}",
            "p.yaml:1:30: pool 'q' serves tool_call turns but has no tool_call_parser",
        ),
        (  # so does a provider's default_pool: at its value in the routing file
            "default: {method: off}\n",
            "{q: {replicas: [http://x]}, " + PARSED + "}",
            "r.yaml:5:19: pool 'q' is provider 'g''s default_pool, so it serves tool_call turns",
        ),
        # an adaptive pool's slot comes from SGLang's running batch, which stops at max_running_requests
        (
            "rules:\n  - name: big\n    match: {turn_type: chat, batch_size: {min: 33, max: 64}}\n"
            "    method: off\n    pool: e\ndefault: {method: off}\n",
            "{e: {replicas: [http://x], launch: {algorithm: EAGLE3, draft_model_path: h, adaptive: true, num_steps: 1, "
            "max_running_requests: 32}}, " + PARSED + "}",
            "p.yaml:3:42: batch_size reaches 64, but adaptive pool 'e' runs at most max_running_requests 32",
        ),
        (
            "rules:\n  - name: all\n    match: {turn_type: chat}\n    method: eagle\n    gamma: 3\n    pool: e\n"
            "default: {method: off}\n",
            "{e: {replicas: [http://x], launch: {algorithm: EAGLE3, draft_model_path: h, adaptive: true, "
            "max_running_requests: 32}}, " + PARSED + "}",
            "p.yaml:3:12: batch_size has no upper bound, but adaptive pool 'e' runs at most max_running_requests 32",
        ),
        (  # the flags must be makeable: an adaptive pool's num_steps is one of the rules' candidates
            "rules:\n  - name: c\n    match: {turn_type: chat, batch_size: {max: 8}}\n    method: eagle\n"
            "    gamma: 3\n    pool: e\ndefault: {method: off}\n",
            "{e: {replicas: [http://x], launch: {algorithm: EAGLE3, draft_model_path: h, adaptive: true, num_steps: 5, "
            "max_running_requests: 8}}, " + PARSED + "}",
            "r.yaml:6:47: pool 'e': num_steps 5 is not among the rules' candidates [3]",
        ),
    ],
)
def test_cross_file_problems_carry_file_line_column(tmp_path, monkeypatch, policy, pools, expected):
    from openalice_runner.pool_checks import check_pool_files

    monkeypatch.chdir(tmp_path)
    Path("p.yaml").write_text(policy)
    inline = pools if pools.startswith("{") else "{" + pools + "}"
    default = "q" if "default_pool" in expected else "p"
    Path("r.yaml").write_text(
        f"providers:\n  g:\n    type: sglang\n    model: m\n    default_pool: {default}\n    pools: {inline}\n"
        "routes:\n  - {name: d, chain: [g]}\n"
    )
    found = [str(p) for p in check_pool_files("p.yaml", "r.yaml")]
    assert any(p.startswith(expected) for p in found), found


def test_rules_for_providers_the_routing_file_lacks_are_not_held_against_it(tmp_path):
    from openalice_runner.pool_checks import check_pool_files

    policy = tmp_path / "p.yaml"
    policy.write_text(
        "rules:\n  - name: elsewhere\n    match: {provider: other, turn_type: chat}\n    method: off\n"
        "    pool: nope\ndefault: {method: off}\n"
    )
    assert check_pool_files(policy, REPO / "providers/gpu-example.yaml") == []
    assert check_pool_files(policy, REPO / "providers/default.yaml") == []  # no SGLang provider at all
