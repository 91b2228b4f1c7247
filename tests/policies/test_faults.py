"""`policy check` agrees with the engine: what the engine refuses, the check refuses, at its place.

A policy offering a separate draft model (`options.draft_model`: the embedded engine drafts from
the target's own first layers only) fails `policy check` with FILE:LINE:COL; the shipped policies
pass it, and every one of their decisions is one the engine's settings accept."""

from __future__ import annotations

import pytest
from locations import REPO

from openalice_runner.cli import main
from openalice_runner.engine.types import SpecConfig
from openalice_runner.policies import PolicyStore

SHIPPED = sorted((REPO / "policies").glob("*.yaml"))

OFFERS_DRAFT_MODEL = """\
version: 1
rules:
  - name: small-drafter
    match: {turn_type: chat}
    method: draft
    gamma: 3
    options: {draft_model: /models/SmolLM2-135M}
default: {method: off}
"""


def test_a_policy_offering_a_draft_model_fails_policy_check_at_the_option(tmp_path, capsys):
    policy = tmp_path / "p.yaml"
    policy.write_text(OFFERS_DRAFT_MODEL)
    assert main(["policy", "check", str(policy)]) == 2
    said = capsys.readouterr()
    assert f"{policy}:7:15: options.draft_model" in said.out + said.err, said


def test_the_same_rule_with_the_self_draft_passes(tmp_path, capsys):
    policy = tmp_path / "p.yaml"
    policy.write_text(OFFERS_DRAFT_MODEL.replace("draft_model: /models/SmolLM2-135M", "draft_layers: 8"))
    assert main(["policy", "check", str(policy)]) == 0, capsys.readouterr()


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_policies_offer_nothing_the_engine_refuses(path, capsys):
    assert main(["policy", "check", str(path)]) == 0, capsys.readouterr()
    assert "draft_model" not in path.read_text()
    policy = PolicyStore.from_file(str(path)).policy
    local = [r for r in policy.rules if r.pool is None] + ([policy.default] if policy.default.pool is None else [])
    for decision in local:
        if decision.method == "off":
            continue
        gamma = 3 if decision.gamma == "auto" else decision.gamma
        options = {k: v for k, v in decision.options.model_dump().items() if v is not None}
        SpecConfig(method=decision.method, gamma=gamma, **options)  # raises where the engine refuses it
