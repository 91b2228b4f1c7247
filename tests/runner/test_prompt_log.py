"""Saved traffic: the runner keeps its requests' prompts, when asked, for `draft train --data`."""

from __future__ import annotations

import json
import logging
import stat

import pytest
from stand_ins.engines import tiny_engine
from stand_ins.streams import read_all

from openalice_runner import Runner
from openalice_runner.prompt_log import PromptLog
from openalice_runner.training.data import read_prompts
from openalice_runner.types import ChatRequest

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]


async def test_runner_keeps_each_prompt_once_for_draft_train(tmp_path):
    path = tmp_path / "traffic" / "prompts.jsonl"
    runner = Runner.from_config(engine=tiny_engine(), telemetry=False, prompt_log=path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # owner-only from the start
    async with runner.turn(conversation_id="c", turn_type="tool_call") as turn:
        await turn.chat([{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS, max_tokens=3)
    chunks = await read_all(runner.stream(ChatRequest(
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                  {"role": "user", "content": "and again"}], max_tokens=2)))
    assert chunks
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [line["turn_type"] for line in lines] == ["tool_call", "chat"]
    assert lines[0]["tools"][0]["function"]["name"] == "get_weather"
    assert lines[1]["messages"][-1] == {"role": "user", "content": "and again"}
    # what draft train reads: message lists ending with the user's turn
    prompts = read_prompts([path])
    assert [p[-1]["content"] for p in prompts] == ["Weather in Oslo?", "and again"]
    await runner.aclose()


def test_off_by_default():
    assert Runner.from_config(engine=tiny_engine(), telemetry=False).prompt_log is None


def test_cap_stops_the_log_with_one_warning(tmp_path, caplog):
    request = ChatRequest(messages=[{"role": "user", "content": "x" * 60}])
    one = PromptLog(tmp_path / "one.jsonl")
    one.record(request, "chat")
    size = (tmp_path / "one.jsonl").stat().st_size
    log = PromptLog(tmp_path / "p.jsonl", max_bytes=2 * size + size // 2)  # room for two lines
    with caplog.at_level(logging.WARNING, logger="openalice_runner.prompt_log"):
        for _ in range(5):
            log.record(request, "chat")
    assert log.written == 2 and (tmp_path / "p.jsonl").stat().st_size == 2 * size
    assert len([r for r in caplog.records if "reached" in r.message]) == 1
    with pytest.raises(ValueError, match="max_bytes"):
        PromptLog(tmp_path / "q.jsonl", max_bytes=0)


def test_a_failing_write_never_fails_the_request(tmp_path, caplog):
    log = PromptLog(tmp_path / "p.jsonl")
    (tmp_path / "p.jsonl").unlink()
    (tmp_path / "p.jsonl").mkdir()  # the path is now a folder: every write fails
    with caplog.at_level(logging.WARNING, logger="openalice_runner.prompt_log"):
        log.record(ChatRequest(messages=[{"role": "user", "content": "x"}]), "chat")
    assert log.written == 0 and "the request goes on" in caplog.text
