"""First constrained requests after start-up in process CPU seconds (docs/benchmarks/2026-12-02-bf16-prefill.md).

    HF_HUB_OFFLINE=1 .venv/bin/python -m openalice_runner.bench.first_request_cpu cold|warm tool-weather tool-calendar tool-weather
"""
import asyncio
import sys
import time
from pathlib import Path

from openalice_runner.bench.workload import load_workload
from openalice_runner.providers.base import CallContext
from openalice_runner.providers.embedded.config import EmbeddedConfig
from openalice_runner.providers.local import EmbeddedProvider
from openalice_runner.types import ChatRequest

# ../shared/workloads beside the checkout
WORKLOAD = Path(__file__).resolve().parents[3] / "shared" / "workloads" / "agentic.jsonl"


async def one(p, cases, cid):
    c = cases[cid]
    req = ChatRequest(messages=c.messages, tools=c.tools, max_tokens=24, temperature=0)
    t = time.process_time()
    await p.chat(req, CallContext(turn_type="tool_call"))
    return time.process_time() - t


def main():
    cases = {c.id: c for c in load_workload(str(WORKLOAD))}
    warm = sys.argv[1] == "warm"
    t = time.process_time()
    p = EmbeddedProvider("local", EmbeddedConfig(type="local", threads=1, warm_up=warm, max_batch=1))
    asyncio.run(p.ensure_loaded())
    print(f"warm_up={warm} load {time.process_time()-t:.2f} CPU s, warm-up {p.warm_up_s}", flush=True)

    async def run():
        for cid in sys.argv[2:]:
            print(cid, f"{await one(p, cases, cid):.3f} CPU s", flush=True)

    asyncio.run(run())


if __name__ == "__main__":
    main()
