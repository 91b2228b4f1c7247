"""`Runner.from_config(policy=...)`: DEFAULT_POLICY and NO_POLICY say what None and False said,
and the older spellings still work."""

from __future__ import annotations

import pytest

from openalice_runner import DEFAULT_POLICY, NO_POLICY, Runner, defaults
from openalice_runner.policies import PolicyStore
from openalice_runner.runner import PolicySetting, policy_setting


@pytest.mark.parametrize("policy", [DEFAULT_POLICY, None], ids=["DEFAULT_POLICY", "None"])
async def test_the_default_policy_is_the_one_shipped(policy):
    runner = Runner.from_config(policy=policy, telemetry=False)
    try:
        assert isinstance(runner.policy, PolicyStore)
        assert runner.policy.path == defaults.path(defaults.POLICY)
    finally:
        await runner.aclose()


@pytest.mark.parametrize("policy", [NO_POLICY, False], ids=["NO_POLICY", "False"])
async def test_no_policy_means_none(policy):
    runner = Runner.from_config(policy=policy, telemetry=False)
    try:
        assert runner.policy is None
    finally:
        await runner.aclose()


async def test_from_config_defaults_to_the_default_policy():
    runner = Runner.from_config(telemetry=False)
    try:
        assert isinstance(runner.policy, PolicyStore)
    finally:
        await runner.aclose()


def test_the_older_spellings_read_as_the_settings():
    assert policy_setting(None) is PolicySetting.DEFAULT
    assert policy_setting(False) is PolicySetting.OFF
    assert policy_setting("p.yaml") == "p.yaml"
