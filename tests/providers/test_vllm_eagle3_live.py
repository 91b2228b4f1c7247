"""Live tier: an EAGLE-3 pool on a real vLLM 0.32.0 CPU server, its head trained by this session (issue 47).

`draft train --layout eagle3` trains a head for the default model (SmolLM2-135M-Instruct) on the chat
prompts shipped in tests/data/eagle3-chat-prompts.jsonl (a few minutes on two cores), into this
session's temporary folder: no weights are committed. A routing file deploys two pools on the
engine's converted folder, `plain` and `eagle3` (`launch: {method: eagle3, draft_model: HEAD}`), both
float32 so that greedy replies can be compared exactly; `policy check --providers` passes the files
(the head's target fingerprint against the pool's model folder), and each server runs the flags
`vllm args` compiles from its pool line. A policy routes chat turns to `eagle3` at γ 3 and
everything else to `plain`.

Checked: chat turns carry accepted drafts, their figures equal the delta of vLLM's own /metrics
spec-decode counters over the request (plain and streamed), and greedy replies equal the plain
pool's. Then the same head in the embedded engine (float32) on the same prompt tokens: acceptance at
each draft position against vLLM's per-position counters, within ACCEPTANCE_TOLERANCE (issue 47,
Build 2). The servers stop at the end of this module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import vllm_servers
import yaml
from locations import REPO, TESTS
from stand_ins.processes import free_port
from tiers import needs_install

from openalice_runner import Runner
from openalice_runner.cli import main
from openalice_runner.policies import PolicyStore
from openalice_runner.pool_checks import find_pool, vllm_pool_launch
from openalice_runner.providers.base import CallContext
from openalice_runner.providers.config import load_routing_file
from openalice_runner.providers.pools.replicas import parse_prometheus_sum
from openalice_runner.types import ChatRequest

pytestmark = [pytest.mark.slow, needs_install(vllm_servers.venv_problem())]

PROMPTS = TESTS / "data" / "eagle3-chat-prompts.jsonl"
K = 3  # num_speculative_tokens: the rule's γ
MAX_TOKENS = 32  # per reply: short, for the CPU
ASKED = 3  # prompts asked of the pools (training prompts: the head has seen them, so it drafts well)
# draft train, small: a couple of minutes on two cores (16 prompts distilled, capped steps)
TRAIN = ["--max-new-tokens", "64", "--batch", "16", "--draft-vocab", "1024", "--max-steps", "150",
         "--minutes", "6", "--seed", "0"]  # fmt: skip
# |vLLM - embedded| acceptance at each draft position on the same prompt tokens, both float32. A
# number the two runs could miss only by drafting differently: the same layout and draft steps give
# the same drafts on the same tokens, up to float32 rounding in near ties.
ACCEPTANCE_TOLERANCE = 0.05
POLICY = f"""\
version: 1
name: eagle3-live
rules:
  - name: chat-eagle3
    match: {{turn_type: chat}}
    method: eagle
    gamma: {K}
    pool: eagle3
default: {{method: "off", pool: plain}}
"""
COUNTERS = ("draft_tokens", "accepted_tokens")


def prompts() -> list[list[dict]]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [[{"role": "user", "content": r["prompt"]}] for r in rows[:ASKED]]


def routing_text(ports: dict[str, int], model: Path, head: Path) -> str:
    def launch(**extra) -> dict:
        return {"model_path": str(model), "max_num_seqs": 4, "max_model_len": 2048, "dtype": "float32",
                "tool_call_parser": "hermes", "chat_template": str(vllm_servers.TEMPLATE),
                "extra_args": ["--enforce-eager"], **extra}  # fmt: skip

    return yaml.safe_dump({
        "providers": {"cpu": {"type": "vllm", "model": "smollm2", "default_pool": "plain", "load_cache_s": 0,
                              "load_stale_s": 0, "first_token_timeout_s": 120, "pools": {
            "plain": {"replicas": [f"http://127.0.0.1:{ports['plain']}"], "launch": launch()},
            "eagle3": {"replicas": [f"http://127.0.0.1:{ports['eagle3']}"],
                       "launch": launch(method="eagle3", draft_model=str(head))},
        }}},
        "routes": [{"name": "default", "chain": ["cpu"]}],
    }, sort_keys=False)  # fmt: skip


class Eagle3Pools:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model = vllm_servers.ensure_model_dir()
        self.head = tmp / "head"
        ports = {"plain": free_port(), "eagle3": free_port()}
        self.routing, self.policy = tmp / "providers.yaml", tmp / "policy.yaml"
        self.routing.write_text(routing_text(ports, self.model, self.head))
        self.policy.write_text(POLICY)
        policy = PolicyStore.from_file(self.policy).policy
        self.servers: dict[str, vllm_servers.VLLMServer] = {}
        self.trained = self._train()  # first: both cores for it (a server's start-up would share them)
        assert main(["policy", "check", str(self.policy), "--providers", str(self.routing)]) == 0
        try:
            for name in ports:
                self._start(name, ports, policy)
            for server in self.servers.values():
                server.wait_ready()
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, ports: dict[str, int], policy) -> None:
        args = vllm_pool_launch(find_pool(load_routing_file(self.routing), name, dialect="vllm"), policy).args
        self.servers[name] = vllm_servers.VLLMServer(args, name=name, port=ports[name]).start(self.tmp)

    def _train(self) -> dict:
        cmd = [sys.executable, "-m", "openalice_runner", "draft", "train", "--data", str(PROMPTS),
               "--layout", "eagle3", "--out", str(self.head), *TRAIN]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = proc.stdout
        return json.loads(out[out.index("{"):])

    def runner(self) -> Runner:
        return Runner.from_config(self.routing, self.policy, telemetry=False)

    def counters(self) -> dict[str, float]:
        return {k: self.servers["eagle3"].metric(f"vllm:spec_decode_num_{k}_total") for k in COUNTERS}

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory):
    started = Eagle3Pools(tmp_path_factory.mktemp("vllm-eagle3"))
    print("head trained:", {k: started.trained.get(k) for k in ("steps", "loss", "minutes_total", "train_tokens")},
          "vLLM start-up (s):", {k: round(s.started_s or 0, 1) for k, s in started.servers.items()})
    yield started
    started.stop()


async def test_chat_turns_on_the_eagle3_pool_accept_drafts_counted_as_vllm_counts_them(eagle3):
    """Each chat turn is routed to the eagle3 pool and carries accepted drafts; its figures are the
    delta of vLLM's own counters over the request (plain, then streamed); greedy, its reply is the
    plain pool's for the same request."""
    accepted, replies = 0, []
    async with eagle3.runner() as runner:
        for messages in prompts():
            request = ChatRequest(messages=messages, max_tokens=MAX_TOKENS, temperature=0)
            before = eagle3.counters()
            r = await runner.chat(request, CallContext(turn_type="chat"))
            after = eagle3.counters()
            s = r.speculation
            assert (s.pool, s.method, s.rule, s.gamma) == ("eagle3", "eagle", "chat-eagle3", K)
            assert s.proposed > 0 and (s.proposed, s.accepted) == (
                after["draft_tokens"] - before["draft_tokens"], after["accepted_tokens"] - before["accepted_tokens"])
            accepted += s.accepted
            replies.append(r.content)
            plain = await runner.chat(request, CallContext(turn_type="reasoning"))  # the default: plain
            assert plain.speculation.pool == "plain" and plain.speculation.method == "off"
            assert r.content == plain.content and r.usage.completion_tokens == plain.usage.completion_tokens
        assert accepted > 0, "the trained head had no draft accepted on the prompts it was trained on"
        before = eagle3.counters()
        request = ChatRequest(messages=prompts()[0], max_tokens=MAX_TOKENS, temperature=0)
        async with runner.stream(request, CallContext(turn_type="chat")) as chunks:
            streamed = [c async for c in chunks]
        after = eagle3.counters()
    final = streamed[-1].speculation
    assert final.pool == "eagle3" and final.accepted > 0
    assert (final.proposed, final.accepted) == (
        after["draft_tokens"] - before["draft_tokens"], after["accepted_tokens"] - before["accepted_tokens"])
    assert "".join(c.delta_text or "" for c in streamed) == replies[0]


def _per_position(url: str) -> tuple[float, list[float]]:
    """vLLM's drafts and accepted drafts at each position (`/metrics`, summed over engines)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    drafts = float(parse_prometheus_sum(text, "vllm:spec_decode_num_drafts_total") or 0.0)
    per_pos = [0.0] * K
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{"):
            labels, value = line.rsplit(" ", 1)
            pos = int(labels.split('position="', 1)[1].split('"', 1)[0])
            if pos < K:
                per_pos[pos] += float(value)
    return drafts, per_pos


def test_the_embedded_engine_and_vllm_accept_the_same_drafts_with_the_same_head(eagle3):
    """Same head, same prompt tokens (the embedded engine renders them; vLLM gets them as
    /v1/completions token ids), greedy, float32, K drafts every round: the same rounds, acceptance
    at each draft position within ACCEPTANCE_TOLERANCE, and the same replies."""
    from openalice_runner.bench.eagle3_rounds import Rounds, vllm_rounds
    from openalice_runner.engine import Engine

    engine = Engine.load(None, dtype="fp32", prefill="fp32")
    ids = [engine.render_chat(m) for m in prompts()]
    url = eagle3.servers["eagle3"].url
    drafts0, pos0 = _per_position(url)
    vllm_replies = []
    for prompt in ids:
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        vllm_replies.append(r.json()["choices"][0]["text"])
    drafts1, pos1 = _per_position(url)
    rounds_v = drafts1 - drafts0
    vllm_rate = [(b - a) / rounds_v for a, b in zip(pos0, pos1, strict=True)]
    # the embedded engine's rounds as vLLM runs them: K drafts in every one (eagle3_rounds.py)
    rounds, embedded_replies = Rounds(K), []
    for prompt in ids:
        tokens = vllm_rounds(engine, eagle3.head, prompt, MAX_TOKENS, rounds)
        embedded_replies.append(engine.tokenizer.decode(tokens, skip_special_tokens=True))
    assert rounds.drafted == {K}
    rounds_e = len(rounds.accepted)
    embedded_rate = rounds.per_position()
    print("acceptance per draft position, vLLM", [round(x, 3) for x in vllm_rate], f"({rounds_v:.0f} rounds);",
          "embedded", [round(x, 3) for x in embedded_rate], f"({rounds_e} rounds)")
    assert rounds_v > 0 and rounds_e > 0 and vllm_rate[0] > 0
    assert vllm_replies == embedded_replies
    for i, (v, e) in enumerate(zip(vllm_rate, embedded_rate, strict=True)):
        assert abs(v - e) <= ACCEPTANCE_TOLERANCE, (i + 1, vllm_rate, embedded_rate)
