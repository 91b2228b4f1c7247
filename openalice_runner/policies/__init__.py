"""Speculation policy: operator YAML -> per-request method and γ, adaptive γ, SGLang launch flags.

from openalice_runner.policies import PolicyStore, RequestContext
store = PolicyStore.from_file("policies/default.yaml", watch=True)
d = store.decide(RequestContext(turn_type="tool_call", batch_size=1, provider="local"))
d.method, d.gamma, d.per_batch   # a SpeculationPlan (openalice_runner.speculation)
"""

from openalice_runner.policies.adaptive import AdaptiveGamma, Choice
from openalice_runner.policies.errors import PolicyError, Problem
from openalice_runner.policies.loader import LoadedPolicy, load_policy_file, load_policy_text
from openalice_runner.policies.plan import CompiledPolicy, RequestContext
from openalice_runner.policies.schema import Policy
from openalice_runner.policies.speedup import best_gamma, expected_speedup, tokens_per_round
from openalice_runner.policies.store import PolicyStore

__all__ = [
    "AdaptiveGamma",
    "Choice",
    "CompiledPolicy",
    "LoadedPolicy",
    "Policy",
    "PolicyError",
    "PolicyStore",
    "Problem",
    "RequestContext",
    "best_gamma",
    "expected_speedup",
    "load_policy_file",
    "load_policy_text",
    "tokens_per_round",
]
