"""`openalice-runner policy ...`: exit codes and JSON contracts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openalice_runner.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    return run_top(capsys, "policy", *argv)


def run_top(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_check_ok_and_problems(capsys, tmp_path):
    assert run(capsys, "check", "policies/default.yaml") == (0, "ok\n", "")
    bad = tmp_path / "bad.yaml"
    bad.write_text("default:\n  method: off\n  gama: 3\n")
    code, out, _ = run(capsys, "check", str(bad))
    assert code == 2
    assert out == f"{bad}:3:3: unknown key 'gama' in default (did you mean 'gamma'?)\n"


def test_explain_json(capsys):
    code, out, _ = run(
        capsys, "explain", "--turn-type", "tool_call", "--batch-size", "1", "--provider", "local", "--json"
    )
    assert code == 0
    d = json.loads(out)
    assert {"method", "gamma", "rule", "reason", "policy_version"} <= d.keys()
    assert d["method"] == "ngram" and d["rule"] == "copy-heavy-small-batch" and d["gamma"] >= 2
    code, out, _ = run(capsys, "explain", "--turn-type", "chat", "--batch-size", "100")
    assert code == 0 and "method off" in out and "default" in out


def test_explain_broken_policy_exits_2(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("default: {method: nope}\n")
    code, _, err = run(capsys, "explain", "--policy", str(bad), "--turn-type", "chat", "--batch-size", "1")
    assert code == 2 and f"{bad}:1:19:" in err


def test_speedup_brief_figures(capsys):
    code, out, _ = run(capsys, "speedup", "--alpha", "0.75", "--gamma", "4", "--draft-cost", "0.15")
    assert code == 0 and "3.05 tokens per round" in out and "1.91x" in out
    code, out, _ = run(capsys, "speedup", "--alpha", "0.75", "--gamma", "4", "--draft-cost", "0.15", "--json")
    d = json.loads(out)
    assert round(d["tokens_per_round"], 2) == 3.05 and round(d["speedup"], 2) == 1.91


def test_speedup_auto_gives_best_gamma(capsys):
    code, out, _ = run(
        capsys,
        "speedup",
        "--alpha",
        "0.9",
        "--gamma",
        "auto",
        "--max-gamma",
        "16",
        "--draft-cost",
        "0.05",
        "--json",
    )
    d = json.loads(out)
    assert code == 0 and d["best_gamma"] == d["gamma"] and 1 <= d["best_gamma"] <= 16
    from openalice_runner.policies.speedup import expected_speedup

    assert all(expected_speedup(0.9, g, 0.05) <= d["speedup"] + 1e-4 for g in range(1, 17))
    code, _, err = run(capsys, "speedup", "--alpha", "0.9", "--gamma", "auto", "--draft-cost", "0.05")
    assert code == 2 and "--max-gamma" in err


def test_speedup_rejects_bad_numbers(capsys):
    with pytest.raises(SystemExit) as info:
        main(["policy", "speedup", "--alpha", "1.5", "--gamma", "4", "--draft-cost", "0.1"])
    assert info.value.code == 2


def test_sglang_args_line_and_json(capsys, tmp_path):
    cfg = tmp_path / "adaptive.json"
    files = ("--providers", "providers/gpu-example.yaml", "--policy", "policies/gpu-sglang.yaml")
    code, out, _ = run(capsys, "sglang-args", *files, "--pool", "eagle3", "--adaptive-config-out", str(cfg))
    assert code == 0 and out.count("\n") == 1
    assert out.startswith(
        "--model-path meta-llama/Llama-3.1-8B-Instruct --speculative-algorithm EAGLE3 --speculative-draft-model-path "
    )
    assert f"--speculative-adaptive --speculative-adaptive-config {cfg}" in out
    assert json.loads(cfg.read_text())["1"]["candidate_steps"] == [1, 3, 5, 7]
    # `sglang args` is the same generator
    code2, out2, _ = run_top(capsys, "sglang", "args", *files, "--pool", "eagle3", "--adaptive-config-out", str(cfg))
    assert (code2, out2) == (code, out)
    code, out, _ = run(capsys, "sglang-args", *files, "--pool", "ngram", "--json")
    d = json.loads(out)
    assert d["args"][2:6] == ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"]
    assert d["adaptive_config"] is None
    code, _, err = run(capsys, "sglang-args", *files, "--pool", "nope")
    assert code == 2 and "unknown pool" in err
    with pytest.raises(SystemExit) as info:  # the pools are the routing file's: it must be named
        main(["policy", "sglang-args", "--policy", "policies/gpu-sglang.yaml", "--pool", "eagle3"])
    assert info.value.code == 2


def test_sglang_args_refuses_files_that_do_not_fit(capsys, tmp_path):
    routing = tmp_path / "routing.yaml"
    routing.write_text(
        Path("providers/gpu-example.yaml").read_text().replace("max_running_requests: 64", "max_running_requests: 32")
    )
    code, out, err = run_top(
        capsys, "sglang", "args", "--providers", str(routing), "--policy", "policies/gpu-sglang.yaml", "--pool", "eagle3"
    )
    assert code == 2 and out == ""
    assert err.startswith("policies/gpu-sglang.yaml:41:") and "max_running_requests 32" in err


def test_check_with_providers_checks_the_rules_against_the_pools(capsys, tmp_path):
    for policy in ("policies/gpu-sglang.yaml", "policies/default.yaml"):
        assert run(capsys, "check", policy, "--providers", "providers/gpu-example.yaml") == (0, "ok\n", "")
    routing = Path("providers/gpu-example.yaml").read_text()
    drifted = tmp_path / "routing.yaml"
    drifted.write_text(
        routing.replace("tool_call_parser: llama3           # this pool serves", "# this pool serves")
        .replace("max_running_requests: 64", "max_running_requests: 32")
        .replace("      plain:", "      plainer:")
        .replace("default_pool: plain", "default_pool: plainer")
    )
    code, out, _ = run(capsys, "check", "policies/gpu-sglang.yaml", "--providers", str(drifted))
    lines = out.splitlines()
    assert code == 2 and len(lines) == 3, out
    lines_of = {line.split(": ", 1)[0]: line for line in lines}
    assert {k.split(":", 1)[0] for k in lines_of} == {"policies/gpu-sglang.yaml"}  # each at the rule
    assert "pool 'ngram' serves tool_call turns but has no tool_call_parser" in lines_of["policies/gpu-sglang.yaml:25:11"]
    assert "batch_size reaches 64, but adaptive pool 'eagle3'" in lines_of["policies/gpu-sglang.yaml:41:55"]
    assert "unknown pool 'plain'" in lines_of["policies/gpu-sglang.yaml:47:9"], out
    # a routing file wrong on its own: its own positions
    drifted.write_text(routing.replace("algorithm: NGRAM", "algorithm: NGRAM\n          eagle_topk: 2"))
    code, out, _ = run(capsys, "check", "policies/gpu-sglang.yaml", "--providers", str(drifted))
    assert code == 2 and out.startswith(f"{drifted}:36:11: pool 'ngram': eagle_topk does not apply to a NGRAM pool")


def test_leftover_pools_key_says_where_pools_live_now(capsys, tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("pools:\n  e: {algorithm: EAGLE3}\ndefault: {method: off}\n")
    code, out, _ = run(capsys, "check", str(old))
    assert code == 2 and out.startswith(f"{old}:1:1: `pools:` moved to the routing file")


def test_sglang_args_names_a_pool_it_cannot_launch_without_a_traceback(capsys, tmp_path):
    # an EAGLE pool with no num_steps and no rule routing to it with speculation on: no step count
    routing = tmp_path / "routing.yaml"
    routing.write_text(Path("providers/gpu-example.yaml").read_text().replace(
        "      plain:                                 # high batch: speculation off",
        "      spare:\n        replicas: [http://10.0.0.41:30000]\n"
        "        launch: {algorithm: EAGLE, draft_model_path: some/eagle-head}\n"
        "      plain:                                 # high batch: speculation off"))
    code, out, err = run_top(
        capsys, "sglang", "args", "--providers", str(routing), "--policy", "policies/gpu-sglang.yaml", "--pool", "spare"
    )
    assert code == 2 and out == ""
    assert err == "error: pool 'spare': no rule routes to it with speculation on; set num_steps\n"
