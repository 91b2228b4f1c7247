"""One name per concept: the outcome (speculation.py), the API's `speculation` block, the CLI's
`stats` JSON and the `bench` JSON call each speculation figure by the same name; the old names
live only in `OLD_KEYS`, as aliases of the names now."""

from __future__ import annotations

import dataclasses

from openalice_runner.bench.runner import Run, report_row
from openalice_runner.bench.workload import Case
from openalice_runner.drafter_options import DRAFTER_OPTIONS, OPTIONS_BY_METHOD
from openalice_runner.engine.types import GenerationStats, SpecConfig
from openalice_runner.policies.schema import MethodOptions
from openalice_runner.speculation import OLD_KEYS, SPEC_METHODS, SpeculationOutcome
from openalice_runner.types import SpeculationInfo

OUTCOME = {f.name for f in dataclasses.fields(SpeculationOutcome)} | {"acceptance_rate", "tokens_per_second"}
# the extras each report carries beside the outcome's names, on purpose
WIRE_EXTRAS = {"closing"}  # of the reply, tokens forced to close its structure
# where the request's turn type and conversation came from (stated or inferred): the request's, not the outcome's
WIRE_EXTRAS |= {"turn_type", "turn_type_source", "conversation_source"}
STATS_EXTRAS = {"prompt_tokens", "cached_prompt_tokens", "closing", "mask_s", "draft_depth_histogram", "finish_reason"}
BENCH_EXTRAS = {"case", "turn_type", "tokens", "seconds", "identical_to_off", "prompt_tokens", "policy_method"}
OLD = {contract: dict(pairs) for contract, pairs in OLD_KEYS.items()}


def _outcome() -> SpeculationOutcome:
    return SpeculationOutcome(method="ngram", gamma=4, completion_tokens=9, target_passes=5, proposed=15,
                              accepted=4, tokens_per_pass=1.8, rule="r", policy_version="v1", pool="p")  # fmt: skip


def _current(keys: set[str], contract: str) -> set[str]:
    return keys - set(OLD[contract])


def test_the_wire_block_uses_the_outcomes_names():
    keys = set(SpeculationInfo.from_outcome(_outcome()).model_dump())
    assert _current(keys, "speculation") - WIRE_EXTRAS <= OUTCOME
    assert {"proposed", "accepted", "forced", "target_passes", "tokens_per_pass"} <= keys


def test_the_cli_stats_use_the_outcomes_names():
    keys = set(GenerationStats(proposed=3, accepted=1, tokens_per_pass=1.5).to_dict())
    assert _current(keys, "stats") - STATS_EXTRAS <= OUTCOME
    assert {"proposed", "accepted", "forced", "target_passes", "tokens_per_pass"} <= keys


def test_the_bench_rows_use_the_outcomes_names():
    case = Case(id="c", turn_type="chat", messages=[], max_tokens=4)
    run = Run(tokens=[1, 2], seconds=0.5, gamma=4, acceptance_rate=0.25, tokens_per_pass=1.5, target_passes=2,
              method_used="ngram", rule="r", policy_version="v1")  # fmt: skip
    keys = set(report_row(case, "policy", run, [1, 2], 7))
    assert _current(keys, "bench") - BENCH_EXTRAS <= OUTCOME | {"method", "rule", "policy_version"}
    assert {"tokens_per_pass", "acceptance_rate", "target_passes"} <= keys


def test_an_old_key_is_an_alias_of_a_name_now_and_carries_its_value():
    outcome = _outcome()
    reports = {
        "speculation": SpeculationInfo.from_outcome(outcome).model_dump(),
        "stats": GenerationStats(proposed=3, accepted=1, forced=2, tokens_per_pass=1.5).to_dict(),
        "bench": report_row(Case(id="c", turn_type="chat", messages=[], max_tokens=4), "off",
                            Run(tokens=[1], seconds=1.0, gamma=0, tokens_per_pass=1.0), None, 3),  # fmt: skip
    }
    for contract, data in reports.items():
        for old, now in OLD[contract].items():
            assert now in OUTCOME | WIRE_EXTRAS and old not in OUTCOME, (contract, old, now)
            assert data[old] == data[now], (contract, old)


def test_the_drafter_options_are_one_table_for_the_policy_file_and_the_engine():
    names = {o.name for o in DRAFTER_OPTIONS}
    assert set(MethodOptions.model_fields) == names
    assert names <= {f.name for f in dataclasses.fields(SpecConfig)}
    assert set(OPTIONS_BY_METHOD) == set(SPEC_METHODS)
    for option in DRAFTER_OPTIONS:
        field = MethodOptions.model_fields[option.name]
        bounds = {type(m).__name__: m for m in field.metadata}
        assert (bounds["Ge"].ge if "Ge" in bounds else None) == option.least, option.name
        assert (bounds["Le"].le if "Le" in bounds else None) == option.hi, option.name
        assert getattr(SpecConfig(), option.name) == option.default, option.name
