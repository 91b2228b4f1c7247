"""bench/huge_pages.py on the tiny model: both sides run, the report has every row, and the switch that
builds the 4 KiB side is put back as it was."""

from __future__ import annotations

import json
import os

from openalice_runner.bench import huge_pages as bench
from openalice_runner.engine.huge_pages import DISABLE_ENV


def test_the_bench_reports_both_sides_per_gap_and_pass(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert DISABLE_ENV not in os.environ
    assert bench.main(["--tiny", "--gaps", "0,0.01", "--rounds", "1", "--passes", "1", "--json", str(out)]) == 0
    assert DISABLE_ENV not in os.environ
    report = json.loads(out.read_text())
    assert set(report["after_idle_s"]) == {"0.0", "0.01"}
    assert set(report["hot_passes"]) == {"1 decode rows", "5 decode rows", "9 decode rows", "64 prompt rows"}
    for row in [*report["after_idle_s"].values(), *report["hot_passes"].values()]:
        assert row["huge_ms"] > 0 and row["4k_ms"] > 0 and row["ratio"] > 0
        assert len(row["runs_ms"]["huge"]) == len(row["runs_ms"]["4k"]) == 1
    assert report["on_huge_pages_bytes"] >= 0 and report["packed_weight_bytes"] > 0
    assert "| 0.01 s |" in capsys.readouterr().out
