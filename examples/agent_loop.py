"""An agent turn with a tool call, against the embedded default model (SmolLM2-135M-Instruct, CPU).

    python examples/agent_loop.py ["What is the weather in Paris?"] [--json]

Step 1: the model asks for a tool. A 135M model rarely chooses to call a tool on its own, so this
call names the function (`tool_choice` = get_weather): the runner then ends the prompt with the
opening of a call block, `<tool_call>{"name": "get_weather", "arguments": `, and the model writes
only the arguments. That is the honest part to watch: the arguments are the model's own.
Step 2: the loop runs the tool inside `turn.tool(...)` (timed and traced).
Step 3: the model answers from the tool's result (tool_choice "none").

The script exits 0 when the model produced a valid call and an answer, 1 otherwise (e.g. the model
wrote arguments that are not valid JSON: they come back as plain content, never as an exception).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from openalice_runner import Runner

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name, e.g. Paris"}},
                "required": ["city"],
            },
        },
    }
]

_WEATHER = {"paris": (21, "sunny"), "london": (14, "light rain"), "tokyo": (26, "humid, cloudy")}


def get_weather(city: str) -> str:
    """A stand-in weather service: deterministic, offline."""
    temp, sky = _WEATHER.get(city.strip().lower(), (18, "partly cloudy"))
    return json.dumps({"city": city, "temperature_c": temp, "conditions": sky})


TOOL_IMPLS = {"get_weather": get_weather}


def run_tool(name: str, arguments: str) -> str:
    """Run one call; a bad call becomes an error message for the model, not a crash of the loop."""
    try:
        args = json.loads(arguments)
        return TOOL_IMPLS[name](**args)
    except (KeyError, TypeError, ValueError) as exc:
        return json.dumps({"error": f"{type(exc).__name__}: {exc}"})


async def agent_turn(runner: Runner, question: str, max_tokens: int = 48) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a concise assistant. Use the tools to answer."},
        {"role": "user", "content": question},
    ]
    transcript: dict[str, Any] = {"question": question, "tool_calls": [], "answer": None, "ok": False}
    async with runner.turn(conversation_id="example-1", turn_type="tool_call", agent="example") as turn:
        ask = await turn.chat(
            messages,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=max_tokens,
        )
        transcript["step1"] = {
            "content": ask.content,
            "finish_reason": ask.finish_reason,
            "speculation": _spec(ask),
        }
        if not ask.tool_calls:
            transcript["error"] = "the model did not write a valid tool call (its text is in step1.content)"
            transcript["steps"] = turn.step
            return transcript
        messages.append(ask.as_message().to_dict())
        for call in ask.tool_calls:
            async with turn.tool(
                call.function.name, call_id=call.id, arguments=call.function.arguments
            ) as step:
                step.result = run_tool(call.function.name, call.function.arguments)
            transcript["tool_calls"].append(
                {
                    "name": call.function.name,
                    "arguments": json.loads(call.function.arguments),
                    "result": step.result,
                }
            )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": step.result})
        answer = await turn.chat(
            messages, tools=TOOLS, tool_choice="none", max_tokens=max_tokens, turn_type="chat"
        )
        transcript["answer"] = answer.content
        transcript["step3"] = {"finish_reason": answer.finish_reason, "speculation": _spec(answer)}
        transcript["steps"] = turn.step
        transcript["ok"] = bool(answer.content and answer.content.strip())
    return transcript


def _spec(result: Any) -> dict[str, Any] | None:
    s = result.speculation
    return s.model_dump(include={"method", "gamma", "acceptance_rate", "rule"}) if s else None


async def main_async(argv: list[str] | None = None, runner: Runner | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("question", nargs="?", default="What is the weather in Paris?")
    parser.add_argument("--json", action="store_true", help="print the transcript as JSON")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    runner = runner or Runner.from_config()
    try:
        transcript = await agent_turn(runner, args.question, args.max_tokens)
    finally:
        await runner.aclose()
    if args.json:
        print(json.dumps(transcript, indent=2))
    else:
        print(f"user: {transcript['question']}")
        for call in transcript["tool_calls"]:
            print(f"tool call: {call['name']}({json.dumps(call['arguments'])}) -> {call['result']}")
        if transcript.get("error"):
            print(f"no tool call: {transcript['error']}\nmodel wrote: {transcript['step1']['content']!r}")
        else:
            print(f"assistant: {transcript['answer']}")
        print(f"steps: {transcript['steps']}")
    return 0 if transcript["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(argv))


if __name__ == "__main__":
    sys.exit(main())
