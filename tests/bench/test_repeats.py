"""Which repeated run a benchmark row keeps (bench/repeats.py): the true median for odd counts, the
slower middle run for even ones, whether the key is seconds or throughput; and bench-loops' use of
it, its conversation kinds from the workload and its warm-up calls, against a scripted server."""

from __future__ import annotations

import json

import httpx
import pytest

from openalice_runner.bench.loops import bench_loops, load_loops
from openalice_runner.bench.repeats import kept_label, kept_run


def test_odd_counts_keep_the_true_median():
    runs = [{"s": s} for s in (5.0, 1.0, 3.0, 9.0, 2.0)]
    assert kept_run(runs, seconds=lambda r: r["s"])["s"] == 3.0
    assert kept_run(runs[:3], seconds=lambda r: r["s"])["s"] == 3.0
    assert kept_run([{"s": 4.0}], seconds=lambda r: r["s"])["s"] == 4.0
    tps = [{"t": t} for t in (10.0, 30.0, 20.0)]
    assert kept_run(tps, throughput=lambda r: r["t"])["t"] == 20.0


def test_even_counts_keep_the_slower_middle_run_whatever_the_key():
    """Before: bench and bench-loops kept the slower of two, bench-concurrency the faster."""
    assert kept_run([{"s": 1.0}, {"s": 2.0}], seconds=lambda r: r["s"])["s"] == 2.0
    assert kept_run([{"t": 10.0}, {"t": 20.0}], throughput=lambda r: r["t"])["t"] == 10.0
    four = [{"s": s} for s in (4.0, 1.0, 3.0, 2.0)]
    assert kept_run(four, seconds=lambda r: r["s"])["s"] == 3.0
    assert kept_run([{"t": t} for t in (40.0, 10.0, 30.0, 20.0)], throughput=lambda r: r["t"])["t"] == 20.0


def test_labels_and_bad_calls():
    assert [kept_label(n) for n in (1, 2, 3, 4)] == ["single run", "slower middle of 2", "median of 3",
                                                      "slower middle of 4"]
    with pytest.raises(ValueError, match="no runs"):
        kept_run([], seconds=float)
    with pytest.raises(ValueError, match="exactly one"):
        kept_run([1.0], seconds=float, throughput=float)
    with pytest.raises(ValueError, match="at least 1"):
        kept_label(0)


def test_concurrency_rows_use_it(monkeypatch):
    """bench-concurrency's row is the slower middle run of an even repeat (it kept the faster)."""
    from openalice_runner.bench import concurrency

    speeds = iter([50.0, 40.0])

    def fake_level(engine, serial, jobs, level, method, policy_store=None):
        return {"concurrency": level, "method": method, "tokens_per_second": next(speeds), "token_ids": [[1]]}

    class FakeEngine:
        max_batch = 4

        def encode(self, text):
            return [1]

        def generate(self, *args, **kwargs):
            return None

    monkeypatch.setattr(concurrency, "run_level", fake_level)
    monkeypatch.setattr(concurrency, "render_case", lambda engine, case: [1])
    report = concurrency.bench_concurrency(FakeEngine(), [object()], [1], ["off"], repeat=2)
    assert report["kept"] == "slower middle of 2"
    assert report["runs"][0]["tokens_per_second"] == 40.0
    assert report["runs"][0]["runs_tokens_per_second"] == [50.0, 40.0]


# ---- bench-loops against a scripted OpenAI-shaped server ---------------------------------------
LOOPS = [
    {"id": "loop-a", "kind": "chat", "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
     "messages": [{"role": "user", "content": "Open a.py."}],
     "steps": [{"call": {"turn_type": "tool_call", "max_tokens": 40, "tool_choice": "required"}},
               {"user": "More."}, {"call": {"turn_type": "chat", "max_tokens": 30}}]},
    {"id": "loop-chat-plan", "tools": [], "messages": [{"role": "user", "content": "Plan a trip."}],
     "steps": [{"call": {"turn_type": "chat", "max_tokens": 6}}]},
    {"id": "loop-b", "tools": [], "messages": [{"role": "user", "content": "Copy this."}],
     "steps": [{"call": {"turn_type": "code_edit", "max_tokens": 6}}]},
]


@pytest.fixture
def loops_file(tmp_path):
    path = tmp_path / "loops.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in LOOPS) + "\n")
    return path


def scripted_client(bodies: list[dict]) -> httpx.Client:
    """Answers GET /models and streamed chat completions (one chunk, usage), recording each body."""
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        bodies.append(json.loads(request.content))
        events = [{"choices": [{"delta": {"content": "ok"}}]},
                  {"choices": [{"delta": {}, "finish_reason": "stop"}]},
                  {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}]
        return httpx.Response(200, text="".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n")

    return httpx.Client(transport=httpx.MockTransport(handle))


def test_kinds_come_from_the_workload_with_the_documented_default(loops_file, tmp_path):
    kinds = {c.id: c.kind for c in load_loops(loops_file)}
    # loop-a says chat; loop-chat-plan has no field and keeps its kind; any other id is copy-heavy
    assert kinds == {"loop-a": "chat", "loop-chat-plan": "chat", "loop-b": "copy_heavy"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**LOOPS[2], "kind": "chatty"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: `kind` must be one of chat, copy_heavy"):
        load_loops(bad)


def test_the_summary_splits_by_the_workload_kinds(loops_file):
    from openalice_runner.bench.loops import Target

    bodies: list[dict] = []
    with scripted_client(bodies) as client:
        report = bench_loops(load_loops(loops_file), [Target("x", "http://x/v1"), Target("y", "http://y/v1")],
                             repeat=3, client=client, warmup=0)
    assert report["kept"] == "median of 3"
    assert {r["id"]: r["kind"] for r in report["conversations"]} == {
        "loop-a": "chat", "loop-chat-plan": "chat", "loop-b": "copy_heavy"}
    for row in report["conversations"]:
        ordered = sorted(row["runs_seconds"])
        assert row["seconds"] == ordered[1]  # the true median of three
    pair = report["summary"]["speedup"]["x/y"]
    assert pair["chat"] is not None and pair["copy_heavy"] is not None


@pytest.mark.parametrize("warmup", [0, 1, 4])
def test_warm_up_calls_come_before_the_timed_runs(loops_file, warmup):
    from openalice_runner.bench.loops import Target

    conversations = load_loops(loops_file)
    bodies: list[dict] = []
    with scripted_client(bodies) as client:
        report = bench_loops(conversations, [Target("x", "http://x/v1")], repeat=1, client=client, warmup=warmup)
    timed = sum(1 for c in conversations for s in c.steps if s.kind == "call")
    assert len(bodies) == warmup + timed
    assert len(report["warmup_seconds"]["x"]) == warmup
    first_calls = [next(s.call for s in c.steps if s.kind == "call") for c in conversations]
    for n, body in enumerate(bodies[:warmup]):
        # shaped like a conversation's first call, under a line no timed call starts with
        shape = first_calls[n % len(conversations)]
        assert body["messages"][0]["content"].startswith(f"Warm-up {n + 1}.\n")
        assert body["max_tokens"] == shape.max_tokens
        assert body.get("tools", []) == conversations[n % len(conversations)].tools
        assert body.get("tool_choice") == shape.tool_choice
    for body in bodies[warmup:]:
        assert body["messages"][0]["content"].startswith("Session 1.\n")
    with pytest.raises(ValueError, match="warmup"):
        bench_loops(conversations, [Target("x", "http://x/v1")], warmup=-1, client=httpx.Client())
