"""A budget past the model's context is clamped to what the context leaves (prompt tokens + budget <=
context, docs/agent-runtimes.md "Budget") and the clamped figure is the reply's x-openalice-max-tokens
header; a prompt that does not fit is the wire's context error. Agent runtimes send max_tokens sized
for hosted models (Claude Code and opencode: 32,000): before this, such a call was a 400.

Real HTTP on loopback to the embedded engine (the tiny random model, context 2,048), behind a spy that
records the budget each generation was given and then runs it short (the figure is what is checked,
not 2,000 tokens of a random model)."""

from __future__ import annotations

import json
from dataclasses import replace

import httpx
import pytest
from stand_ins.engines import tiny_engine
from support.live_server import LiveServer

from openalice_runner.providers.base import ProviderBadRequest
from openalice_runner.providers.config import load_routing_text
from openalice_runner.providers.embedded.prompt import ContextBounds, Prompt
from openalice_runner.runner import Runner
from openalice_runner.server.app import ServerSettings, create_app

CONTEXT = 2048  # the tiny random model's
RUN_TOKENS = 3  # what the spy lets each generation run


class BudgetSpy:
    def __init__(self, real) -> None:
        self.real = real
        self.budgets: list[int] = []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def stream(self, prompt_ids, sampling, spec, cancel=None, grammar=None):
        self.budgets.append(sampling.max_tokens)
        assert len(prompt_ids) + sampling.max_tokens <= self.real.context_length
        short = replace(sampling, max_tokens=min(RUN_TOKENS, sampling.max_tokens))
        yield from self.real.stream(prompt_ids, short, spec, cancel, grammar=grammar)


PROVIDERS = """
providers:
  local: {type: local, tiny_random: true, max_tokens_default: 8}
routes:
  - {name: default, chain: [local]}
"""


@pytest.fixture(scope="module")
def server():
    engine = BudgetSpy(tiny_engine())
    assert engine.context_length == CONTEXT
    runner = Runner.from_config(providers=load_routing_text(PROVIDERS), policy=False, telemetry=False, engine=engine)
    live = LiveServer(create_app(runner, settings=ServerSettings(request_timeout_s=30))).start()
    live.engine = engine
    yield live
    live.stop()


def _post(server, body):
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_a_budget_past_the_context_is_clamped_to_what_the_prompt_leaves(server):
    r = _post(server, {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 32_000})
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert server.engine.budgets[-1] == CONTEXT - prompt_tokens
    assert r.headers["x-openalice-max-tokens"] == str(CONTEXT - prompt_tokens)


def test_a_budget_within_the_context_is_kept_and_shown(server):
    r = _post(server, {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5})
    assert r.status_code == 200, r.text
    assert server.engine.budgets[-1] == 5 and r.headers["x-openalice-max-tokens"] == "5"


def test_a_streamed_reply_shows_its_clamped_budget_in_its_headers(server):
    body = {
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 32_000,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        header = r.headers["x-openalice-max-tokens"]
    usage = json.loads(lines[-1][6:])["usage"]
    assert header == str(CONTEXT - usage["prompt_tokens"]) == str(server.engine.budgets[-1])


def test_a_prompt_that_does_not_fit_is_the_context_error_whatever_the_budget(server):
    runs = len(server.engine.budgets)
    words = " ".join(f"w{i}" for i in range(2500))  # about 5,000 tokens
    r = _post(server, {"messages": [{"role": "user", "content": words}], "max_tokens": 32_000})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert f"context is {CONTEXT} tokens" in error["message"]
    assert len(server.engine.budgets) == runs  # refused before the engine


def test_the_budget_rule():
    bounds = ContextBounds("local", lambda: 100, lambda: None)
    prompt = Prompt(ids=list(range(90)), prefill="", tool_names=None)
    assert bounds.budget(prompt, 32_000) == 10  # 90 + 10 = the context
    assert bounds.budget(prompt, 4) == 4
    assert ContextBounds("local", lambda: None, lambda: None).budget(prompt, 32_000) == 32_000  # not loaded
    with pytest.raises(ProviderBadRequest) as info:
        bounds.check_prompt(Prompt(ids=list(range(100)), prefill="", tool_names=None))
    assert info.value.code == "context_length_exceeded"
