"""The benchmarks' reports are a contract: the fields, the summary that states each issue's bar,
and the order in which repeats run. On the tiny random model, so they run in seconds."""

from __future__ import annotations

import json

import pytest

from openalice_runner.bench import runner
from openalice_runner.bench.concurrency import bench_concurrency
from openalice_runner.bench.workload import load_workload
from openalice_runner.engine import Engine
from openalice_runner.policies import PolicyStore

RUN_FIELDS = {
    "case", "turn_type", "method", "gamma", "tokens", "seconds", "tokens_per_second", "acceptance_rate",
    "tokens_per_pass", "target_passes", "identical_to_off",
}  # fmt: skip


@pytest.fixture(scope="module")
def engine():
    return Engine.tiny_random(seed=3, max_batch=4)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    path = tmp_path_factory.mktemp("workload") / "tiny.jsonl"
    lines = [
        {"id": "edit", "turn_type": "code_edit", "max_tokens": 12,
         "messages": [{"role": "user", "content": "def f(x):\n    return x + 1\n" * 4}]},
        {"id": "hello", "turn_type": "chat", "max_tokens": 10,
         "messages": [{"role": "user", "content": "Say hello."}]},
    ]  # fmt: skip
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return load_workload(path)


def test_bench_report_fields_and_summary(engine, cases):
    store = PolicyStore.from_file("policies/default.yaml")
    report = runner.bench(engine, cases, ["off", "ngram", "ngram:5", "ngram:8", "policy"], gamma=7, policy_store=store)
    # pass costs were timed before the first case, so no method's drafts depend on the one before
    assert all(engine.pass_costs.seconds(rows) for rows in (1, 2, 3, 4, 6, 8, 12, 17))
    assert len(report["runs"]) == 2 * 5
    for row in report["runs"]:
        assert row.keys() >= RUN_FIELDS
        if row["method"] != "off":
            assert row["identical_to_off"] is True  # greedy, fp32: speculation is lossless
    gammas = {r["method"]: r["gamma"] for r in report["runs"] if r["case"] == "edit"}
    assert gammas["ngram"] == 7 and gammas["ngram:5"] == 5 and gammas["ngram:8"] == 8
    summary = report["summary"]
    bar = summary["policy_vs_best_of_off_ngram5"]
    assert set(bar["per_case"]) == {"edit", "hello"}
    assert bar["min"] == min(bar["per_case"].values())
    assert bar["cases_at_least_0.95"].endswith("/2")
    aggregate = summary["copy_heavy_aggregate_tokens_per_second"]
    edit = {r["method"]: r for r in report["runs"] if r["case"] == "edit"}
    assert aggregate["ngram:8"] == round(edit["ngram:8"]["tokens"] / edit["ngram:8"]["seconds"], 2)
    assert set(aggregate) == {"off", "ngram", "ngram:5", "ngram:8", "policy"}
    assert "copy_heavy_geomean" in summary["ngram_vs_off"]
    table = runner.format_table(report)
    assert table.startswith(f"rows: {report['kept']}")  # what each row keeps, named
    assert table.count("\n") == 3 + 1  # that line, header, rule, two cases


def test_repeats_go_round_the_methods(engine, cases, monkeypatch):
    calls = []
    real = runner._one

    def recording(engine, case, prompt, method, *args, **kwargs):
        calls.append((case.id, method))
        return real(engine, case, prompt, method, *args, **kwargs)

    monkeypatch.setattr(runner, "_one", recording)
    runner.bench(engine, cases[:1], ["off", "ngram:3"], repeat=3)
    assert calls == [("edit", "off"), ("edit", "ngram:3")] * 3


def test_bench_refuses_unknown_methods(engine, cases):
    with pytest.raises(ValueError, match="unknown methods"):
        runner.bench(engine, cases, ["off", "magic"])
    with pytest.raises(ValueError, match="needs --policy"):
        runner.bench(engine, cases, ["policy"])
    with pytest.raises(ValueError, match="needs --eagle-head"):
        runner.bench(engine, cases, ["eagle-lookup:4"])


def test_eagle_lookup_is_eagle_with_prompt_lookup():
    assert runner.split_method("eagle-lookup:4", 5) == ("eagle-lookup", 4)
    assert runner.METHOD_OPTIONS["eagle-lookup"] == ("eagle", {"eagle_lookup": True})


def test_tree_nodes_reach_the_tree_methods_and_bad_values_exit_2(engine, cases, monkeypatch, capsys):
    specs = []
    monkeypatch.setattr(runner, "run_engine", lambda engine, prompt, max_tokens, spec: specs.append(spec)
                        or runner.Run(tokens=[1], seconds=1.0, gamma=spec.gamma))
    runner.bench(engine, cases[:1], ["eagle-lookup-tree:4", "eagle-tree:3", "eagle:4"], eagle_head="unused",
                 tree_nodes=16)
    assert [(s.eagle_tree, s.eagle_lookup, s.gamma) for s in specs] == [(16, True, 4), (16, False, 3), (0, False, 4)]
    from openalice_runner.cli import main

    for bad in ("1", "64"):
        assert main(["bench", "--workload", "unused.jsonl", "--tree-nodes", bad]) == 2
        assert "--tree-nodes" in capsys.readouterr().err


def test_bench_concurrency_report(engine, cases):
    serial = Engine(engine.hf_model, engine.tokenizer, engine.model_name, engine.dtype, max_batch=1)
    report = bench_concurrency(engine, cases, [1, 2], ["off", "ngram:3", "serial-off"], serial=serial)
    rows = {(r["concurrency"], r["method"]): r for r in report["runs"]}
    assert set(rows) == {(1, "off"), (1, "ngram:3"), (1, "serial-off"), (2, "off"), (2, "ngram:3")}
    for row in rows.values():
        assert row["tokens"] > 0 and row["tokens_per_second"] > 0
        assert row["latency_p50_s"] <= row["latency_p95_s"]
        assert row["identical_to_off"] in (True, None)
    assert rows[(2, "off")]["requests"] == 4  # at least 2 x concurrency requests
    three = bench_concurrency(engine, [*cases, cases[0]], [1, 2], ["off"])["runs"]
    # whole passes over the cases at every level, so each level runs the same mix of turns
    assert [r["requests"] for r in three] == [3, 6]
    with pytest.raises(ValueError, match="max-batch"):
        bench_concurrency(engine, cases, [8], ["off"])


def test_bench_concurrency_repeat_goes_round_levels_and_methods_and_keeps_the_median(engine, cases, monkeypatch):
    from openalice_runner.bench import concurrency

    calls = []
    real = concurrency.run_level

    def recording(engine, serial, jobs, level, method, policy_store=None):
        calls.append((level, method))
        return real(engine, serial, jobs, level, method, policy_store)

    monkeypatch.setattr(concurrency, "run_level", recording)
    report = bench_concurrency(engine, cases, [1, 2], ["off", "ngram:3"], repeat=3)
    assert calls == [(1, "off"), (1, "ngram:3"), (2, "off"), (2, "ngram:3")] * 3
    for row in report["runs"]:
        runs = sorted(row["runs_tokens_per_second"])
        assert len(runs) == 3 and row["tokens_per_second"] == runs[1]
        assert row["identical_to_off"] is True


def test_bench_follow_up_report(engine, cases):
    from openalice_runner.bench.follow_up import bench_follow_up, format_table

    assert engine.scheduler.prefix_reuse is False
    report = bench_follow_up(engine, cases, max_tokens=6, repeat=2)
    assert engine.scheduler.prefix_reuse is False  # restored
    assert [r["case"] for r in report["runs"]] == ["edit", "hello"]
    for r in report["runs"]:
        assert set(r["ttft_s"]) == set(r["total_s"]) == {"full", "reuse"}
        assert r["identical"] and 0 < r["cached_tokens"] < r["prompt_tokens"]
    s = report["summary"]
    assert s["identical"] == "2/2" and s["cached_tokens"] == sum(r["cached_tokens"] for r in report["runs"])
    assert len(format_table(report).splitlines()) == 6  # header, rule, two cases, blank, summary
    with pytest.raises(ValueError, match="batching engine"):
        bench_follow_up(Engine.tiny_random(seed=3, max_batch=1), cases)
