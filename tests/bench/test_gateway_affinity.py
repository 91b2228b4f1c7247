"""The gateway benchmark's pieces that need no server: smg's command line per policy, the budget cap,
and the /metrics counters it reads (the live run is by hand: docs/benchmarks/2026-12-02-gateway-affinity.md)."""

from __future__ import annotations

import httpx

from openalice_runner.bench.gateway_affinity import ROUTING_HEADER, cache_counters, capped, smg_command
from openalice_runner.bench.loops import Call, Conversation, Step


def test_smg_command_keys_consistent_hashing_on_the_conversation_id():
    workers = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    line = smg_command("consistent_hashing", workers, 9000)
    assert line[1:2] == ["launch"] and line[line.index("--worker-urls") + 1:][:2] == workers
    assert line[line.index("--backend") + 1] == "vllm" and line[line.index("--policy") + 1] == "consistent_hashing"
    # the header bench-loops' run_conversation sends, once per conversation run
    assert line[line.index("--routing-key-headers") + 1] == ROUTING_HEADER == "x-openalice-conversation-id"
    assert "--routing-key-headers" not in smg_command("cache_aware", workers, 9000)


def test_budgets_are_capped_and_nothing_else_changes():
    c = Conversation("x", [], [{"role": "user", "content": "hi"}],
                     [Step("call", Call("tool_call", 64, "required")), Step("user", text="more"),
                      Step("call", Call("chat", 8))])
    out = capped(c, 16)
    assert [s.call.max_tokens for s in out.steps if s.call] == [16, 8]
    assert out.steps[0].call.tool_choice == "required" and out.steps[1].text == "more"
    assert c.steps[0].call.max_tokens == 64  # the workload's own copy is left alone


def test_cache_counters_sum_the_workers():
    def handle(request: httpx.Request) -> httpx.Response:
        n = 1 if request.url.port == 1 else 2
        return httpx.Response(200, text=f'# HELP x\nvllm:prefix_cache_hits_total{{engine="0"}} {10.0 * n}\n'
                                        f'vllm:prefix_cache_queries_total{{engine="0"}} {40.0 * n}\n')

    with httpx.Client(transport=httpx.MockTransport(handle)) as client:
        assert cache_counters(client, ["http://h:1", "http://h:2"]) == (30.0, 120.0)
