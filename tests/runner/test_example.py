"""examples/agent_loop.py: a multi-step turn with a tool call.

The slow test runs it as a user would, against the real default model (SmolLM2-135M): the model
writes the call's arguments, the loop runs the tool, the model answers from the result.
The fast test drives the same loop code with the tiny random model behind a scripted local engine
(exact model output), so the mechanics are checked on every run.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from locations import REPO
from stand_ins.scripted_engine import WEATHER_ANSWERS, ScriptedEngine

from openalice_runner import Runner

EXAMPLE = REPO / "examples" / "agent_loop.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("agent_loop_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_agent_loop_mechanics(capsys):
    example = _load_example()
    engine = ScriptedEngine(WEATHER_ANSWERS, completion_tokens=5)
    runner = Runner.from_config(engine=engine, telemetry=False)
    code = await example.main_async(["--json"], runner=runner)
    transcript = json.loads(capsys.readouterr().out)
    assert code == 0 and transcript["ok"] and transcript["steps"] == 3
    (call,) = transcript["tool_calls"]
    assert call["name"] == "get_weather" and call["arguments"] == {"city": "Paris"}
    assert json.loads(call["result"])["temperature_c"] == 21
    assert transcript["answer"] == "It is 21 degrees and sunny in Paris."
    assert 'The get_weather tool returned: {"city": "Paris", "temperature_c": 21' in engine.prompt_texts[1]


@pytest.mark.slow
def test_agent_loop_with_the_real_default_model():
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    transcript = json.loads(proc.stdout[proc.stdout.index("{") :])
    (call,) = transcript["tool_calls"]
    assert call["name"] == "get_weather" and call["arguments"].get("city")
    assert "error" not in json.loads(call["result"])  # the model's arguments fit the tool
    assert transcript["answer"].strip() and transcript["steps"] == 3
