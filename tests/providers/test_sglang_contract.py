"""Contract tier: the SGLang stand-in and the runner's requests checked against SGLang 0.5.23's own code.

Every body the stand-in sends (plain, tool calls, speculation details, streamed chunks, errors) must
be one SGLang's pydantic/msgspec protocol classes accept and serialize back to exactly; every body
the provider sends must be one SGLang's ChatCompletionRequest accepts. Needs the side venv that
`scripts/sglang-contract-venv.sh` makes (SGLang is no dependency: it needs a GPU to serve); set
OPENALICE_SGLANG_VENV to it. Skipped, saying so, without it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
from locations import TESTS
from stand_ins.sglang_server import SGLangStandIn
from stand_ins.streams import read_all
from tiers import needs_install

from openalice_runner.providers.base import CallContext, ProviderBadRequest, StreamBroken
from openalice_runner.providers.pools.sglang.provider import SGLangConfig, SGLangProvider
from openalice_runner.types import ChatRequest

VENV = os.environ.get("OPENALICE_SGLANG_VENV") or str(  # scripts/sglang-contract-venv.sh; .ci/run caches it here
    Path(os.environ.get("OPENALICE_CACHE_DIR", Path.home() / ".cache" / "openalice-runner"), "venvs", "sglang-contract-0.5.23")
)
PYTHON = Path(VENV, "bin", "python") if VENV else None
CHECKER = TESTS / "contract" / "sglang_check.py"

needs_venv = needs_install(
    None if PYTHON is not None and PYTHON.exists() else
    f"SGLang contract venv absent at {VENV}: run scripts/sglang-contract-venv.sh and set OPENALICE_SGLANG_VENV"
)  # fmt: skip

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def run_checker(payload: dict) -> dict:
    assert PYTHON is not None
    proc = subprocess.run(
        [str(PYTHON), str(CHECKER)], input=json.dumps(payload), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


async def _exercise(stand_in: SGLangStandIn, pool: dict) -> None:
    """Plain, tool-call, streamed and failing requests through the provider."""
    cfg = SGLangConfig.model_validate({"type": "sglang", "model": stand_in.model, "pools": {"p": pool}})
    p = SGLangProvider("gpu", cfg)
    plain = ChatRequest(
        messages=[{"role": "user", "content": "one two three four five"}], temperature=0.2, seed=3
    )
    tool = ChatRequest(
        messages=[{"role": "user", "content": "Paris"}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
    )
    auto = ChatRequest(
        messages=[{"role": "user", "content": "get_weather in Rome"}], tools=TOOLS, max_tokens=50
    )
    allowed = ChatRequest(  # sent as the allowed tools under the plain mode (SGLang has no allowed_tools form)
        messages=[{"role": "user", "content": "Paris"}],
        tools=[*TOOLS, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}],
        tool_choice={"type": "allowed_tools", "allowed_tools": {
            "mode": "required", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}},
    )
    for req in (plain, tool, auto, allowed):
        await p.chat(req, CallContext())
        _ = await read_all(p.stream(req, CallContext()))
    await p.chat(plain, CallContext(tenant="team-a"))  # a tenant's body: its cache_salt (issue 48)
    stand_in.faults.fail_next = [400]
    with pytest.raises(ProviderBadRequest):
        await p.chat(plain, CallContext())
    stand_in.faults.error_after_chunks = 1
    with pytest.raises(StreamBroken):
        _ = await read_all(p.stream(plain, CallContext()))
    stand_in.faults.error_after_chunks = None
    await p.aclose()
    # a caller that asks for meta_info (the provider does not): the old place of the counters
    async with httpx.AsyncClient() as client:
        body = {
            "model": stand_in.model,
            "messages": [{"role": "user", "content": "a b c"}],
            "return_meta_info": True,
        }
        stand_in.responses.append(
            (await client.post(f"{stand_in.url}/v1/chat/completions", json=body)).json()
        )


def _split(stand_in: SGLangStandIn) -> dict:
    responses = [r for r in stand_in.responses if r.get("object") == "chat.completion"]
    chunks = [r for r in stand_in.responses if r.get("object") == "chat.completion.chunk"]
    return {"requests": stand_in.requests, "responses": responses, "chunks": chunks}


@needs_venv
@pytest.mark.parametrize("method", ["off", "eagle"])
async def test_stand_in_bodies_are_sglang_0_5_23_bodies(method):
    with SGLangStandIn(method=method, tool_call_parser="llama3") as s:
        launch = {"algorithm": "EAGLE3", "draft_model_path": "h", "num_steps": 3} if method == "eagle" else {}
        await _exercise(s, {"replicas": [s.url], "launch": launch})
        async with httpx.AsyncClient() as client:
            err = await client.post(f"{s.url}/v1/chat/completions", json={"messages": []})
        payload = _split(s)
    payload["errors"] = [err.json()]
    if method == "eagle":  # the streamed sglext chunk and the plain sglext were both sent
        assert any("sglext" in c for c in payload["chunks"]) and any(
            "sglext" in r for r in payload["responses"]
        )
    assert any(r["choices"][0]["message"].get("tool_calls") for r in payload["responses"])
    result = run_checker(payload)
    assert result["failures"] == []
    assert result["checked"]["responses"] == len(payload["responses"]) >= 4
    assert result["checked"]["requests"] == len(payload["requests"])
    assert result["checked"]["chunks"] == len(payload["chunks"]) > 10
    assert result["checked"]["errors"] == 1


@needs_venv
async def test_stand_in_without_tool_call_parser_is_sglang_shaped_too():
    with SGLangStandIn() as s:
        await _exercise(s, {"replicas": [s.url]})
        payload = _split(s)
    assert not any(r["choices"][0]["message"].get("tool_calls") for r in payload["responses"])
    assert run_checker(payload)["failures"] == []
