"""`openalice-runner policy ...`: exit codes and JSON contracts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openalice_runner.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["policy", *argv])
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
    code, out, _ = run(
        capsys,
        "sglang-args",
        "--policy",
        "policies/gpu-sglang.yaml",
        "--pool",
        "eagle3",
        "--adaptive-config-out",
        str(cfg),
    )
    assert code == 0 and out.count("\n") == 1
    assert out.startswith("--speculative-algorithm EAGLE3 --speculative-draft-model-path ")
    assert f"--speculative-adaptive --speculative-adaptive-config {cfg}" in out
    assert json.loads(cfg.read_text())["1"]["candidate_steps"] == [1, 3, 5, 7]
    code, out, _ = run(
        capsys, "sglang-args", "--policy", "policies/gpu-sglang.yaml", "--pool", "ngram", "--json"
    )
    d = json.loads(out)
    assert d["args"][:4] == ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"]
    assert d["adaptive_config"] is None
    code, _, err = run(capsys, "sglang-args", "--policy", "policies/gpu-sglang.yaml", "--pool", "nope")
    assert code == 2 and "unknown pool" in err


def test_check_with_providers_compares_the_pools_of_both_files(capsys, tmp_path):
    for policy in ("policies/gpu-sglang.yaml", "policies/default.yaml"):
        assert run(capsys, "check", policy, "--providers", "providers/gpu-example.yaml") == (0, "ok\n", "")
    routing = Path("providers/gpu-example.yaml").read_text()
    drifted = tmp_path / "routing.yaml"
    drifted.write_text(
        routing.replace(
            "lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B", "jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B"
        )
        .replace("num_draft_tokens: 8", "num_draft_tokens: 6")
        .replace("      plain:", "      plainer:")
        .replace("default_pool: plain", "default_pool: plainer")
    )
    code, out, _ = run(capsys, "check", "policies/gpu-sglang.yaml", "--providers", str(drifted))
    lines = out.splitlines()
    assert code == 2 and len(lines) == 3, out
    lines_of = {line.split(": ", 1)[0]: line for line in lines}
    at = {line.split(": ", 1)[0].split(":", 1)[0] for line in lines}
    assert at == {"policies/gpu-sglang.yaml", str(drifted)}
    assert any(
        "launch.draft_model_path is 'jamesliu1/" in v and k.startswith(f"{drifted}:21:")
        for k, v in lines_of.items()
    )
    assert any("launch.num_draft_tokens is 6, but the policy launches it with 8" in v for v in lines)
    assert any(
        "pool 'plain' is no pool of an SGLang provider" in v and k.endswith(":70:9") for k, v in lines_of.items()
    ), out
