"""`openalice-runner trace report` on a trace the Runner wrote (tiny embedded engine, file exporter)."""

from __future__ import annotations

import json

import pytest

from openalice_runner.cli import main
from openalice_runner.providers.config import RoutingConfig
from openalice_runner.runner import Runner
from openalice_runner.tracing.report import percentile
from openalice_runner.tracing.setup import configure_telemetry

TURNS = 3


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "trace.jsonl"
    providers = configure_telemetry("file", str(path), set_global=False)
    routing = RoutingConfig.model_validate(
        {
            "providers": {"local": {"type": "local", "tiny_random": True}},
            "routes": [{"name": "d", "chain": ["local"]}],
        }
    )
    runner = Runner.from_config(
        providers=routing,
        policy=False,
        tracer_provider=providers.tracer_provider,
        meter_provider=providers.meter_provider,
    )

    async def turns() -> None:
        for i in range(TURNS):
            async with runner.turn(conversation_id=f"c{i}", turn_type="tool_call", agent="alice") as turn:
                await turn.chat([{"role": "user", "content": f"question {i}"}], max_tokens=6)
                async with turn.tool("get_weather", call_id=f"call_{i}"):
                    pass
                await turn.chat([{"role": "user", "content": f"answer {i}"}], max_tokens=6)
        async with runner.turn(turn_type="chat") as turn:
            await turn.chat([{"role": "user", "content": "hi"}], max_tokens=4)
        await runner.aclose()

    import asyncio

    asyncio.run(turns())
    providers.shutdown()
    return path


def test_report_json_per_turn_type_and_step(trace_file, capsys):
    assert main(["trace", "report", str(trace_file), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    turns = {t["turn_type"]: t for t in report["turns"]}
    assert turns["tool_call"]["count"] == TURNS and turns["tool_call"]["steps_mean"] == 3
    assert turns["chat"]["count"] == 1
    rows = {(r["turn_type"], r["step"], r["kind"]): r for r in report["steps"]}
    assert set(rows) == {
        ("tool_call", 1, "chat"),
        ("tool_call", 2, "tool"),
        ("tool_call", 3, "chat"),
        ("chat", 1, "chat"),
    }
    first = rows[("tool_call", 1, "chat")]
    assert first["count"] == TURNS
    assert first["latency_ms_p50"] <= first["latency_ms_p95"]
    assert first["ttft_ms_p50"] > 0 and first["tokens_per_s_p50"] > 0
    assert first["method"] == "off" and first["acceptance_rate"] is None
    assert rows[("tool_call", 2, "tool")]["tools"] == {"get_weather": TURNS}


def test_report_table_and_waterfall_png(trace_file, tmp_path, capsys):
    png = tmp_path / "turn.png"
    assert main(["trace", "report", str(trace_file), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "turn type" in out and "p95 ms" in out and "tool_call" in out
    assert "waterfall of turn" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_a_named_turn_and_reject_unknown(trace_file, tmp_path, capsys):
    spans = [json.loads(x) for x in trace_file.read_text().splitlines()]
    chat_turn = next(
        s
        for s in spans
        if s["name"].startswith("invoke_agent") and s["attributes"].get("openalice.turn.type") == "chat"
    )
    png = tmp_path / "chat.png"
    assert (
        main(
            [
                "trace",
                "report",
                str(trace_file),
                "--plot",
                str(png),
                "--turn",
                chat_turn["trace_id"],
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["plot"]["steps"] == 1
    assert main(["trace", "report", str(trace_file), "--plot", str(png), "--turn", "nope"]) == 2
    assert "no invoke_agent span" in capsys.readouterr().err


def test_missing_file_is_a_clear_error(tmp_path, capsys):
    assert main(["trace", "report", str(tmp_path / "absent.jsonl")]) == 2
    assert "error:" in capsys.readouterr().err


def test_percentile_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([5.0], 95) == 5.0
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 95) == 95.0
    assert percentile(values, 100) == 100.0
