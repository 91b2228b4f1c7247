"""Routing config: the shipped files load; mistakes are reported as FILE:LINE:COL."""

from __future__ import annotations

from pathlib import Path

import pytest

from openalice_runner.providers.config import (
    RoutingConfig,
    RoutingConfigError,
    load_routing_file,
    load_routing_text,
)

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_files_load():
    assert load_routing_file(ROOT / "providers/default.yaml") == RoutingConfig.default()
    gpu = load_routing_file(ROOT / "providers/gpu-example.yaml")
    assert set(gpu.providers) == {"gpu", "cloud", "local"}
    assert gpu.providers["gpu"].pools["eagle3"].adaptive and gpu.providers["gpu"].pools["eagle3"].gamma == 7
    assert gpu.providers["gpu"].pools["plain"].method == "off"  # quoted "off" stays a string
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
    ],
)
def test_problems_carry_file_line_column(text, expected):
    with pytest.raises(RoutingConfigError) as info:
        load_routing_text(text, "f.yaml")
    assert expected in str(info.value), str(info.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(RoutingConfigError, match="cannot read"):
        load_routing_file(tmp_path / "nope.yaml")
