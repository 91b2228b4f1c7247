"""What `Runner.from_config(policy=...)` takes, resolved: a policy file, a PolicyStore (or anything with
`decide` / `observe`), the policy shipped in the package, or none."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeAlias

from openalice_runner import defaults
from openalice_runner.speculation import SpeculationPolicy

if TYPE_CHECKING:
    from openalice_runner.policies.store import PolicyStore


class PolicySetting(enum.Enum):
    """`Runner.from_config(policy=...)` when it is neither a file nor a PolicyStore."""

    DEFAULT = "default"  # the policy shipped in the package (openalice_runner/defaults/policy.yaml)
    OFF = "off"  # no policy: every call runs without speculation


DEFAULT_POLICY = PolicySetting.DEFAULT
NO_POLICY = PolicySetting.OFF

# What `from_config` takes as its policy. None and False are the older spellings of DEFAULT_POLICY
# and NO_POLICY, still accepted.
PolicyArg: TypeAlias = "str | Path | SpeculationPolicy | PolicySetting | None | Literal[False]"


def policy_setting(policy: PolicyArg) -> str | Path | SpeculationPolicy | PolicySetting:
    """`policy` with the older spellings read: None is DEFAULT_POLICY, False is NO_POLICY."""
    if policy is None:
        return PolicySetting.DEFAULT
    if policy is False:
        return PolicySetting.OFF
    return policy


def policy_file(policy: str | Path | SpeculationPolicy | PolicySetting) -> str | Path | None:
    """The file a resolved setting names (DEFAULT: the packaged policy); None for an object or OFF."""
    if policy is PolicySetting.DEFAULT:
        return defaults.path(defaults.POLICY)
    return policy if isinstance(policy, str | Path) else None


def policy_store(
    policy: str | Path | SpeculationPolicy | PolicySetting, watch: bool
) -> PolicyStore | SpeculationPolicy | None:
    """The policy the Runner asks: a PolicyStore read from the setting's file, the caller's own
    object (watched where it is a PolicyStore and `watch`), or None for OFF."""
    if policy is PolicySetting.OFF:
        return None
    if policy is PolicySetting.DEFAULT:
        policy = defaults.path(defaults.POLICY)
    if isinstance(policy, str | Path):
        from openalice_runner.policies.store import PolicyStore

        return PolicyStore.from_file(policy, watch=watch)
    if watch:
        getattr(policy, "start_watching")()  # noqa: B009 (a PolicyStore's; the protocol lacks it)
    return policy  # a PolicyStore (or anything with decide/observe)
