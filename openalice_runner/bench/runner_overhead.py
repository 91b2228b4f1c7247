"""What a request through the Runner costs on top of the same request straight to the engine.

    python -m openalice_runner.bench.runner_overhead [--n 200] [--max-tokens 4] [--real-model]

Same prompt, same greedy settings, speculation off on both paths, so the engine does identical
work; the runner path adds request validation, routing, the policy decision (a policy whose
default is "off"), the tracing wrapper (on the global OpenTelemetry API, a no-op unless the
application installed a provider), fallback, the worker-thread hop and result building.
The two paths alternate request by request (after a warm-up) so drift hits both alike; the
medians and their difference are printed, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

MESSAGES = [{"role": "user", "content": "Say hi."}]
OFF_POLICY = "version: 1\nname: bench-off\ndefault:\n  method: off\n"


async def measure(n: int, max_tokens: int, real_model: bool) -> dict[str, float]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from openalice_runner import Runner
    from openalice_runner.engine import Engine, SamplingParams, SpecConfig
    from openalice_runner.policies import PolicyStore

    engine = Engine.load() if real_model else Engine.tiny_random()
    runner = Runner.from_config(engine=engine, policy=PolicyStore.from_text(OFF_POLICY, "bench-off"))
    sampling, spec = SamplingParams(max_tokens=max_tokens), SpecConfig()

    def direct() -> float:
        t0 = time.perf_counter()
        engine.generate(engine.render_chat(MESSAGES), sampling, spec)
        return time.perf_counter() - t0

    async def through_runner(turn) -> float:
        t0 = time.perf_counter()
        await turn.chat(MESSAGES, max_tokens=max_tokens)
        return time.perf_counter() - t0

    direct_s: list[float] = []
    runner_s: list[float] = []
    async with runner.turn(conversation_id="bench", turn_type="chat", agent="bench") as turn:
        for _ in range(10):  # warm-up: caches, thread pool, first-call imports
            direct()
            await through_runner(turn)
        for i in range(n):
            if i % 2:
                direct_s.append(direct())
                runner_s.append(await through_runner(turn))
            else:
                runner_s.append(await through_runner(turn))
                direct_s.append(direct())
    await runner.aclose()
    d, r = statistics.median(direct_s), statistics.median(runner_s)
    return {
        "model": engine.model_name,
        "n": n,
        "direct_ms": d * 1e3,
        "runner_ms": r * 1e3,
        "overhead_ms": (r - d) * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200, help="requests per path")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument(
        "--real-model", action="store_true", help="SmolLM2-135M instead of the tiny random model"
    )
    args = parser.parse_args(argv)
    out = asyncio.run(measure(args.n, args.max_tokens, args.real_model))
    print(f"model {out['model']}, {out['n']} requests per path, {args.max_tokens} tokens each")
    print(f"median straight to the engine: {out['direct_ms']:.3f} ms")
    print(f"median through the Runner:     {out['runner_ms']:.3f} ms")
    print(f"difference (runner overhead):  {out['overhead_ms']:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
