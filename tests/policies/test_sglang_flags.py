"""SGLang launch flags compiled from a routing file's pool and the policy rules naming it, checked against
SGLang's own argument parser when available.

SGLang is not a dependency (it needs a GPU). To run the parser check, make the contract venv
(`scripts/sglang-contract-venv.sh`, then OPENALICE_SGLANG_VENV=/tmp/sglang-contract), or unpack its wheel:
    pip download --no-deps sglang -d /tmp/sgl && cd /tmp/sgl && unzip -q sglang-*.whl 'sglang/*' -d src
and set OPENALICE_SGLANG_SRC=/tmp/sgl/src. Its import needs a few small packages beyond ours (msgspec,
orjson, pybase64, pyzmq, IPython, traitlets, triton); install them into a throwaway folder with
`pip install --no-deps --target DIR ...` and set OPENALICE_SGLANG_SITE=DIR.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tiers import needs_install

from openalice_runner.policies import PolicyStore, load_policy_text
from openalice_runner.pool_checks import find_pool, pool_launch
from openalice_runner.providers.config import load_routing_file
from openalice_runner.providers.pools.sglang.args import compile_pool, gamma_candidates
from openalice_runner.providers.pools.sglang.launch import SGLangLaunch

ROUTING = "providers/gpu-example.yaml"
MODEL = ["--model-path", "meta-llama/Llama-3.1-8B-Instruct"]


def gpu_policy():
    return PolicyStore.from_file("policies/gpu-sglang.yaml").policy


def launch_of(pool: str, adaptive_config_path: str | None = None, policy_file: str = "policies/gpu-sglang.yaml"):
    deployed = find_pool(load_routing_file(ROUTING), pool)
    return pool_launch(deployed, PolicyStore.from_file(policy_file).policy, adaptive_config_path)


def test_eagle3_adaptive_pool_flags():
    launch = launch_of("eagle3", "/tmp/x.json")
    a = launch.args
    assert a[a.index("--speculative-algorithm") + 1] == "EAGLE3"
    steps = int(a[a.index("--speculative-num-steps") + 1])
    assert a[a.index("--speculative-eagle-topk") + 1] == "1"
    assert int(a[a.index("--speculative-num-draft-tokens") + 1]) == steps + 1  # SGLang's rule for topk 1
    assert a[a.index("--speculative-adaptive-config") + 1] == "/tmp/x.json"
    # batch-size keys are the lower bounds of the rules' batch ranges
    cfg = launch.adaptive_config
    assert {k for k in cfg if k.isdigit()} == {"1", "9", "33"}
    assert cfg["1"]["candidate_steps"] == [1, 3, 5, 7]
    assert cfg["9"]["candidate_steps"] == [1, 2, 3]
    assert cfg["33"]["candidate_steps"] == [0]
    assert steps in {s for k, v in cfg.items() if k.isdigit() for s in v["candidate_steps"]}
    assert a[-4:] == ["--tool-call-parser", "llama3", "--max-running-requests", "64"]


def test_ngram_and_plain_pools():
    ngram = launch_of("ngram").args
    assert ngram[:2] == MODEL  # the provider's model is the servers' --model-path
    assert ngram[2:6] == ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"]
    assert ngram[ngram.index("--speculative-ngram-max-bfs-breadth") + 1] == "2"
    assert ngram[ngram.index("--tool-call-parser") + 1] == "llama3"  # it serves the tool_call turns
    assert launch_of("plain").args == [*MODEL, "--tool-call-parser", "llama3"]


def test_the_example_files_name_the_same_pools():
    """The policy example's rules name only pools the routing example deploys, and its default pool
    is the routing file's (the one pool definition is the routing file's; there is nothing to drift)."""
    policy = gpu_policy()
    gpu = load_routing_file(ROUTING).providers["gpu"]
    named = {r.pool for r in policy.rules} | {policy.default.pool}
    assert named == set(gpu.pools)
    assert policy.default.pool == gpu.default_pool
    assert gpu.pools["eagle3"].method == "eagle" and gpu.pools["ngram"].method == "ngram"
    assert gpu.pools["plain"].method == "off"


def test_extra_args_and_reasoning_parser_follow_the_generated_flags():
    launch = SGLangLaunch(algorithm="NONE", reasoning_parser="qwen3", extra_args=["--mem-fraction-static", "0.8"])
    assert compile_pool(launch, "p", None).args == ["--reasoning-parser", "qwen3", "--mem-fraction-static", "0.8"]


def test_fixed_eagle_pool_takes_gamma_from_rules():
    launch = SGLangLaunch(algorithm="EAGLE", draft_model_path="/h", eagle_topk=4, num_draft_tokens=16)
    policy = load_policy_text(
        textwrap.dedent("""\
        rules:
          - name: chat
            match: {turn_type: chat}
            method: eagle
            gamma: 5
            pool: e
        default: {method: off}
        """)
    ).policy
    a = compile_pool(launch, "e", policy).args
    assert a[a.index("--speculative-num-steps") + 1] == "5"
    assert a[a.index("--speculative-eagle-topk") + 1] == "4"
    assert a[a.index("--speculative-num-draft-tokens") + 1] == "16"
    assert "--speculative-adaptive" not in a


def test_gamma_candidates():
    assert gamma_candidates(1, 3) == [1, 2, 3]
    assert gamma_candidates(1, 7) == [1, 3, 5, 7]
    assert gamma_candidates(2, 8) == [2, 4, 6, 8]
    assert gamma_candidates(1, 8) == [1, 3, 5, 7, 8]


_CHECK = """
import argparse, json, shlex, sys
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.adaptive_spec_params import resolve_candidate_steps_from_config
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
ns = parser.parse_args(["--model-path", "m", *shlex.split(sys.argv[1])])
out = {k: v for k, v in vars(ns).items()
       if k.startswith("speculative") or k in ("tool_call_parser", "reasoning_parser", "max_running_requests",
                                                "model_path")}
if ns.speculative_adaptive_config:
    out["candidate_steps"] = resolve_candidate_steps_from_config(ns.speculative_adaptive_config)
print(json.dumps(out))
"""


_VENV = os.environ.get("OPENALICE_SGLANG_VENV") or str(  # scripts/sglang-contract-venv.sh; .ci/run caches it here
    Path(os.environ.get("OPENALICE_CACHE_DIR", Path.home() / ".cache" / "openalice-runner"), "venvs", "sglang-contract-0.5.23")
)
_SRC = os.environ.get("OPENALICE_SGLANG_SRC")


def _sglang_python() -> tuple[str, dict] | None:
    """The interpreter (and environment) that imports SGLang: the contract venv, else unpacked sources."""
    if _VENV and Path(_VENV, "bin", "python").exists():
        return str(Path(_VENV, "bin", "python")), dict(os.environ)
    if _SRC and Path(_SRC, "sglang/srt/server_args.py").exists():
        paths = [_SRC, os.environ.get("OPENALICE_SGLANG_SITE", "")]
        return sys.executable, {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    return None


@needs_install(
    None if _sglang_python() is not None else
    f"SGLang not available at {_VENV}: run scripts/sglang-contract-venv.sh and set OPENALICE_SGLANG_VENV "
    "(or OPENALICE_SGLANG_SRC, see this module's docstring) to parse with SGLang's own parser"
)  # fmt: skip
@pytest.mark.parametrize(("policy_file", "pool"), [
    ("policies/gpu-sglang.yaml", "eagle3"), ("policies/gpu-sglang.yaml", "ngram"),
    ("policies/gpu-sglang.yaml", "plain"), ("policies/default.yaml", "eagle3"),
])  # fmt: skip
def test_flags_parse_with_sglang_parser(policy_file, pool, tmp_path):
    launch = launch_of(pool, str(tmp_path / "adaptive.json"), policy_file)
    launch.write_adaptive_config()
    python, env = _sglang_python()  # type: ignore[misc]
    proc = subprocess.run(
        [python, "-c", _CHECK, launch.line()],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    a = launch.args
    assert parsed["tool_call_parser"] == "llama3"
    if "--max-running-requests" in a:
        assert parsed["max_running_requests"] == int(a[a.index("--max-running-requests") + 1])
    if pool == "plain":
        assert parsed["speculative_algorithm"] is None
        return
    assert parsed["model_path"] == MODEL[1]
    assert parsed["speculative_algorithm"] == a[a.index("--speculative-algorithm") + 1]
    assert parsed["speculative_num_draft_tokens"] == int(a[a.index("--speculative-num-draft-tokens") + 1])
    if pool == "eagle3":  # the head folder SGLang loads as the EAGLE-3 draft
        assert parsed["speculative_draft_model_path"] == a[a.index("--speculative-draft-model-path") + 1]
        assert parsed["speculative_adaptive"] is True
        assert parsed["speculative_num_steps"] in parsed["candidate_steps"]
        assert parsed["speculative_eagle_topk"] == 1
    if pool == "ngram":
        assert parsed["speculative_ngram_max_bfs_breadth"] == 2
        assert parsed["speculative_ngram_match_type"] == "BFS"


def test_docs_launch_lines_are_the_generated_ones():
    """docs/sglang.md shows each pool's launch line and adaptive JSON: they must be what
    `sglang args` prints for the example files."""
    doc = Path("docs/sglang.md").read_text()
    for pool in ("eagle3", "ngram", "plain"):
        launch = launch_of(pool)
        assert launch.line() in doc, pool
        if launch.adaptive_config is not None:
            assert json.dumps(launch.adaptive_config) in doc
