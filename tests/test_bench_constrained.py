"""`bench-constrained` on the tiny model: every mode runs, the constrained modes agree token for token."""

from __future__ import annotations

from openalice_runner.bench.constrained import MODES, bench_constrained, format_table
from openalice_runner.bench.workload import load_workload


def test_bench_constrained_runs_every_mode(tiny_engine, workload_path):
    cases = load_workload(workload_path, ["tool-weather", "rag-quote"])
    cases = [c.__class__(**{**c.__dict__, "max_tokens": 24}) for c in cases]
    report = bench_constrained(tiny_engine, cases, gamma=3)
    assert [r["case"] for r in report["runs"]] == ["tool-weather", "rag-quote-json"]
    for row in report["runs"]:
        assert set(row["modes"]) == set(MODES)
        assert row["constrained_identical"]  # greedy: the grammar's tokens, however drafted
        assert row["modes"]["constrained-forced"]["forced"] > 0
        assert row["modes"]["constrained-off"]["forced"] == 0
    assert "constrained+forced+ngram" in format_table(report)
