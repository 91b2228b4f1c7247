"""`serve --stream-release` below the server (issue 48, Build 1): what a token is at the chunk layer,
fixed:N's groups, paced's clock (on an injected clock, never wall time), the padding's buckets, and
the flag's bad values. tests/server/test_release.py runs the modes through `serve` on all three wires."""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import statistics
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stand_ins.streams import joined_tool_calls

from openalice_runner.cli import build_parser
from openalice_runner.providers.base import StreamBroken
from openalice_runner.server.release import clocked as clocked_module
from openalice_runner.server.release.clocked import clock_rate, clocked
from openalice_runner.server.release.fixed import fixed
from openalice_runner.server.release.modes import ReleaseMode, parse_release
from openalice_runner.server.release.paced import MAX_RATE_KEYS, RECENT_STREAMS, Pacer, PaceRates, paced
from openalice_runner.server.release.padding import bucket, padded
from openalice_runner.server.release.units import Cutter, cut
from openalice_runner.server.settings import ServerSettings
from openalice_runner.types import (
    ChatChunk,
    ChunkChoice,
    FunctionCallDelta,
    SpeculationInfo,
    ToolCallDelta,
    Usage,
)

# ---------------------------------------------------------------- a scripted stream


def text(piece: str, first: bool = False) -> ChatChunk:
    return ChatChunk.text("chatcmpl-1", "m", piece, role=first)


def call_piece(index: int, arguments: str, *, name: str | None = None) -> ChatChunk:
    delta = ToolCallDelta(index=index, id=f"call_{index}" if name else None, type="function" if name else None,
                          function=FunctionCallDelta(name=name, arguments=arguments or None))  # fmt: skip
    return ChatChunk.piece("chatcmpl-1", "m", tool_calls=[delta])


def final() -> ChatChunk:
    return ChatChunk(id="chatcmpl-1", model="m", choices=[ChunkChoice(finish_reason="tool_calls")],
                     usage=Usage.of(11, 29), speculation=SpeculationInfo(method="ngram", gamma=3, accepted=7))  # fmt: skip


def script() -> list[ChatChunk]:
    """Passes of 1 to 5 tokens, a word cut across passes, then two tool calls cut mid-argument."""
    return [
        text("The", first=True), text(" quick brown"), text(" fox jum"), text("ps over the lazy"),
        text(" dog and"), text(" then it"), text(" calls"),
        call_piece(0, '{"city": "Pa', name="get_weather"), call_piece(0, 'ris", "days"'), call_piece(0, ": 3}"),
        call_piece(1, "", name="get_time"), call_piece(1, '{"zone": "CET"}'),
        final(),
    ]  # fmt: skip


async def _stream(chunks: list[ChatChunk]):
    for chunk in chunks:
        yield chunk


def _collect(groups_of) -> list[list[ChatChunk]]:
    async def run():
        return [group async for group in groups_of]

    return asyncio.run(run())


def _joined(chunks: list[ChatChunk]) -> tuple[str, list[dict[str, str]]]:
    return "".join(c.delta_text for c in chunks), joined_tool_calls(chunks)


def units_of(group: list[ChatChunk]) -> int:
    """Tokens in a group, counted from what a client sees: words of the text, each call's opening,
    the arguments cut as units.py cuts them."""
    count = 0
    for chunk in group:
        count += len(cut(chunk.delta_text)) if chunk.delta_text else 0
        for delta in chunk.tool_call_deltas:
            count += 1 if delta.id else 0
            arguments = delta.function.arguments if delta.function else None
            count += len(cut(arguments)) if arguments else 0
    return count


# ---------------------------------------------------------------- tokens at the chunk layer


@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=60), st.lists(st.integers(0, 60), max_size=8))
@settings(max_examples=300, deadline=None)
def test_a_text_cut_in_passes_gives_the_units_of_the_whole_text(whole, cuts):
    """Where units end is a function of the text alone, never of where the passes ended."""
    assert "".join(cut(whole)) == whole  # nothing lost
    bounds = sorted({0, len(whole), *(c for c in cuts if c <= len(whole))})
    cutter, units = Cutter(), []
    for a, b in itertools.pairwise(bounds):
        if b > a:
            units += [atom.text for atom in cutter.feed(text(whole[a:b]))]
    units += [atom.text for atom in cutter.flush()]
    assert units == cut(whole)


def test_units_are_about_a_token_each():
    assert cut("Hello world, it's 2026!") == ["Hello", " world", ",", " it", "'", "s", " 202", "6", "!"]
    assert cut('{"city": "Paris"}') == ['{"', "city", '":', ' "', "Paris", '"}']


# ---------------------------------------------------------------- fixed:N


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64])
def test_fixed_groups_hold_n_tokens_each_and_lose_nothing(n):
    groups = _collect(fixed(_stream(script()), n))
    counts = [units_of(group) for group in groups]
    assert all(count == n for count in counts[:-1]), counts
    assert 0 < counts[-1] <= n or (counts[-1] == 0 and len(groups) == 1)
    out = [chunk for group in groups for chunk in group]
    assert _joined(out) == _joined(script())
    assert out[0].delta.role == "assistant" and all(c.delta.role is None for c in out[1:])
    # the last chunk goes last and whole: finish reason, usage, speculation
    ends = [c for c in out if c.finish_reason or c.usage or c.speculation]
    assert ends == [out[-1]] and out[-1].usage == final().usage and out[-1].speculation == final().speculation
    assert out[-1].finish_reason == "tool_calls" and out[-1] in groups[-1]


def test_fixed_release_is_the_same_whatever_the_passes():
    """The same text in other passes leaves in the same groups: their boundaries say nothing."""
    one_pass = [text("".join(c.delta_text for c in script()[:7]), first=True), *script()[7:]]
    a = [[(c.delta_text, c.tool_call_deltas) for c in g] for g in _collect(fixed(_stream(script()), 3))]
    b = [[(c.delta_text, c.tool_call_deltas) for c in g] for g in _collect(fixed(_stream(one_pass), 3))]
    assert a == b


# ---------------------------------------------------------------- paced, on an injected clock


class FakeClock:
    """Virtual time: waits return at once, time jumping to the next timer (a pass's arrival) or to the
    tick asked for, whichever is first."""

    def __init__(self) -> None:
        self.t = 0.0
        self.timers: list[tuple[float, int, asyncio.Future]] = []
        self.seq = itertools.count()

    def now(self) -> float:
        return self.t

    def at(self, t: float) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self.timers, (t, next(self.seq), future))
        return future

    async def wait(self, pending, until):
        while True:
            for _ in range(20):  # lets the reading task run to its next wait
                await asyncio.sleep(0)
            if pending is not None and pending.done():
                return
            if self.timers and (until is None or self.timers[0][0] <= until):
                t, _, future = heapq.heappop(self.timers)
                self.t = max(self.t, t)
                future.set_result(None)
                continue
            assert until is not None, "a wait with nothing to wait for"
            self.t = max(self.t, until)
            return


def word_passes(sizes: list[int], gap: float) -> list[tuple[float, ChatChunk]]:
    """Passes of `sizes` words (one token each: letters only), `gap` apart, then the last chunk."""
    words = ("".join(letters) for letters in itertools.product("abcdefghij", repeat=3))
    out = []
    for k, size in enumerate(sizes):
        piece = "".join(f" {next(words)}" for _ in range(size))
        out.append((k * gap, text(piece, first=k == 0)))
    out.append((len(sizes) * gap, ChatChunk(id="chatcmpl-1", model="m", choices=[ChunkChoice(finish_reason="stop")],
                                            usage=Usage.of(3, sum(sizes)))))  # fmt: skip
    return out


def run_paced(passes, prior: float | None):
    """(time, tokens) of each event, and (time, passes so far) of each arrival."""
    clock = FakeClock()
    events: list[tuple[float, int, list[ChatChunk]]] = []
    arrivals: list[float] = []

    async def upstream():
        for t, chunk in passes:
            await clock.at(t)
            arrivals.append(clock.now())
            yield chunk

    async def main():
        async for group in paced(upstream(), Pacer(prior=prior), clock):
            events.append((clock.now(), units_of(group), group))

    asyncio.run(main())
    return events, arrivals


def _gaps(events) -> list[float]:
    times = [t for t, units, _ in events if units]
    return [b - a for a, b in itertools.pairwise(times)]


def _steady(gaps: list[float]) -> float:
    """The tick of a stream whose gaps are whole ticks (a tick that found nothing to send is skipped,
    the clock keeps its grid), nearly all of them single; returns the tick."""
    tick = statistics.median(gaps)
    ticks = [gap / tick for gap in gaps]
    assert all(abs(t - round(t)) < 0.1 and round(t) >= 1 for t in ticks), ticks
    assert sum(round(t) == 1 for t in ticks) >= 0.9 * len(ticks), ticks
    return tick


def test_paced_gaps_are_steady_whatever_tokens_each_pass_accepted():
    """Passes of 1 to 3 tokens every 0.1 s (20 tokens/s): one token an event on a 0.05 s clock, as
    for passes of 2 each: the gaps do not show the passes."""
    sizes = [1, 3, 2, 2, 3, 1] * 6
    uneven, _ = run_paced(word_passes(sizes, 0.1), prior=20.0)
    even, _ = run_paced(word_passes([2] * 36, 0.1), prior=20.0)
    ticks = []
    for events in (uneven, even):
        assert all(units == 1 for _, units, _ in events), [u for _, u, _ in events]
        ticks.append(_steady(_gaps(events)[1:]))
        assert ticks[-1] == pytest.approx(0.05, rel=0.05)
    assert ticks[0] == pytest.approx(ticks[1], rel=0.03)
    out = [c for *_, g in uneven for c in g]
    assert "".join(c.delta_text for c in out) == "".join(c.delta_text for _, c in word_passes(sizes, 0.1))


def test_paced_learns_the_rate_without_recent_streams_and_records_it():
    rates = PaceRates()
    events, _ = run_paced(word_passes([2] * 30, 0.1), prior=None)
    assert _steady(_gaps(events)[4:]) == pytest.approx(0.05, rel=0.05)
    pacer = rates.pacer("m")
    assert pacer.prior is None
    rates.record("m", 20.0)
    rates.record("m", 30.0)
    assert rates.pacer("m").prior == pytest.approx(20.0)  # the slowest of the key's recent streams
    for i in range(MAX_RATE_KEYS + 10):  # bounded, the oldest dropped, the latest kept
        rates.record(f"model-{i}", 5.0)
    assert len(rates.recent) == MAX_RATE_KEYS and "m" not in rates.recent and f"model-{MAX_RATE_KEYS + 9}" in rates.recent


def test_a_keys_clock_starts_from_the_slowest_of_its_recent_streams():
    """Not their mean: a stream slower than its clock stalls, and its gaps then show its text (a
    chat turn's after fast ones, measured: docs/benchmarks/2026-12-05-side-channel-4.md). A stream leaves the
    window RECENT_STREAMS streams later."""
    rates = PaceRates()
    rates.record("k", 30.0)
    for rate in (90.0, 80.0, 100.0):
        rates.record("k", rate)
    assert rates.rate("k") == 30.0
    for _ in range(RECENT_STREAMS - 3):  # 30 is now the ninth stream back
        rates.record("k", 100.0)
    assert rates.rate("k") == 80.0
    rates.record("other", 500.0)
    assert rates.rate("k") == 80.0 and rates.rate("other") == 500.0


def test_paced_is_never_more_than_one_pass_behind():
    """A pass of 12 tokens among passes of 1: what the clock has not sent of it by the next pass but
    one goes at once; at every arrival of pass k+1 every token of passes up to k-1 has left."""
    sizes = [1, 1, 1, 12, 1, 1, 1, 1, 1, 1]
    passes = word_passes(sizes, 0.1)
    events, arrivals = run_paced(passes, prior=10.0)
    assert any(units > 1 for _, units, _ in events), "the big pass forced no catch-up"
    for k in range(2, len(sizes)):  # arrival of pass k+1 (index k)
        released = sum(units for t, units, _ in events if t <= arrivals[k])
        # a pass's last word completes with the next pass's text (units.py): complete by pass k-1
        complete = sum(sizes[: k - 1]) - 1
        assert released >= complete, (k, released, complete)
    out = [c for *_, g in events for c in g]
    assert "".join(c.delta_text for c in out) == "".join(c.delta_text for _, c in passes)
    assert out[-1].usage == passes[-1][1].usage and out[-1].finish_reason == "stop"


def test_paced_stream_with_tool_calls_loses_nothing():
    passes = [(0.05 * k, chunk) for k, chunk in enumerate(script())]
    events, _ = run_paced(passes, prior=None)
    out = [c for *_, g in events for c in g]
    assert _joined(out) == _joined(script())
    assert out[-1].usage == final().usage and out[-1].speculation == final().speculation
    content, calls = _joined(script())
    whole = len(cut(content)) + sum(1 + len(cut(call["arguments"])) for call in calls)
    assert sum(units for _, units, _ in events) == whole  # each token once


# ---------------------------------------------------------------- a stream that breaks


@pytest.mark.parametrize("mode", ["fixed", "paced"])
def test_a_broken_stream_still_sends_what_it_produced_then_its_error(mode):
    """As in pass mode, where every chunk before the fault went out: the text produced before it
    leaves, then the fault ends the stream (the server writes its error event)."""
    sent = script()[:5]

    async def broken():
        for chunk in sent:
            await asyncio.sleep(0)
            yield chunk
        raise StreamBroken("upstream cut", provider="p")

    async def run():
        groups = []
        stream = fixed(broken(), 4) if mode == "fixed" else paced(broken(), Pacer(prior=1.0), FakeClock())
        with pytest.raises(StreamBroken):
            async for group in stream:
                groups.append(group)
        return [chunk for group in groups for chunk in group]

    out = asyncio.run(run())
    assert "".join(c.delta_text for c in out) == "".join(c.delta_text for c in sent)


# ---------------------------------------------------------------- padding, modes, the flag


def test_buckets_are_powers_of_two_from_1k():
    assert [bucket(n) for n in (1, 1024, 1025, 3000, 5000)] == [1024, 1024, 2048, 4096, 8192]
    for size in (0, 100, 1020, 1021, 1022, 1024, 4000):
        data = b"x" * size
        out = padded(data)
        assert len(out) == bucket(size + 3) and out.endswith(data)
        comment = out[: len(out) - size]  # a block of its own: a comment line and the blank line
        assert comment.startswith(b":") and comment.endswith(b"\n\n") and comment.count(b"\n") == 2


@pytest.mark.parametrize("value, mode", [("pass", ReleaseMode()), ("paced", ReleaseMode("paced")),
                                         ("fixed:1", ReleaseMode("fixed", 1)), (" fixed:16 ", ReleaseMode("fixed", 16)),
                                         ("paced+pad", ReleaseMode("paced", pad_length=True)),
                                         ("fixed:4+pad", ReleaseMode("fixed", 4, pad_length=True))])  # fmt: skip
def test_modes_parse(value, mode):
    assert parse_release(value) == mode
    assert parse_release(str(mode)) == mode
    assert ServerSettings(stream_release=value).stream_release == mode


@pytest.mark.parametrize("value", ["", "fixed", "fixed:", "fixed:0", "fixed:-1", "fixed:257", "fixed:2.5",
                                   "fixed:٣", "Paced", "burst", "pass,paced", "pass+pad", "paced+",
                                   "fixed:4+pad+pad", "+pad"])  # fmt: skip
def test_bad_values_of_the_flag_are_refused_naming_it(value, capsys):
    with pytest.raises(ValueError, match="expected pass, fixed:N"):
        parse_release(value)
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--stream-release", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --stream-release: expected pass, fixed:N" in err and repr(value.strip()[:40]) in err


def test_the_flag_defaults_to_pass():
    args = build_parser().parse_args(["serve"])
    assert args.stream_release == ReleaseMode("pass")
    assert isinstance(build_parser(), argparse.ArgumentParser)


# ---------------------------------------------------------------- the clock of recent streams (clocked.py)


def run_clocked(passes, n: int, rate: float, pad_to: int | None = None):
    """(time, tokens, group) of each write, and the stream's own rate as reported at its end."""
    clock = FakeClock()
    events: list[tuple[float, int, list[ChatChunk]]] = []
    measured: list[float | None] = []

    async def upstream():
        for t, chunk in passes:
            await clock.at(t)
            yield chunk

    async def main():
        async for group in clocked(fixed(upstream(), n), n, rate, clock, pad_to=pad_to, on_end=measured.append):
            events.append((clock.now(), units_of(group), group))

    asyncio.run(main())
    return events, measured[0]


def _on_grid(times: list[float], period: float) -> list[float]:
    """Each time as periods after the stream's start (0), asserting it is a whole number of them."""
    slots = [t / period for t in times]
    assert all(abs(s - round(s)) < 1e-6 for s in slots), slots
    return [round(s) for s in slots]


@pytest.mark.parametrize("n", [1, 4])
def test_clocked_writes_leave_on_the_same_points_whatever_each_pass_accepted(n):
    """The engine ahead of the clock (passes of 1 to 3 tokens every 0.05 s: 40 tokens/s, the clock
    at 32): uneven passes and even ones give the same writes at the same times, on the grid."""
    sizes = [1, 3, 2, 2, 3, 1] * 4
    uneven, measured = run_clocked(word_passes(sizes, 0.05), n, rate=32.0)
    even, _ = run_clocked(word_passes([2] * 24, 0.05), n, rate=32.0)
    assert [(t, u) for t, u, _ in uneven] == [(t, u) for t, u, _ in even]
    slots = _on_grid([t for t, *_ in uneven], n / 32.0)
    assert slots == list(range(clocked_module.LEAD_SLOTS, clocked_module.LEAD_SLOTS + len(slots)))
    assert all(u == n for _, u, _ in uneven[:-1])
    out = [c for *_, g in uneven for c in g]
    assert "".join(c.delta_text for c in out) == "".join(c.delta_text for _, c in word_passes(sizes, 0.05))
    assert out[-1].usage == Usage.of(3, 48) and out[-1].finish_reason == "stop"
    assert measured == pytest.approx(40.0, rel=0.15)  # the stream's own rate, for the next streams


def test_clocked_stalls_show_as_whole_periods_only():
    """The engine behind the clock (a pass of 1 token every 0.3 s, the clock at 10 a second): every
    write still leaves on a grid point."""
    events, _ = run_clocked(word_passes([1] * 8, 0.3), 1, rate=10.0)
    _on_grid([t for t, *_ in events], 0.1)
    assert sum(u for _, u, _ in events) == 8


def test_clocked_lag_is_bounded_in_time():
    """The engine far ahead (a pass of 10 tokens every 0.05 s, the clock at 4 a second): no token waits
    more than MAX_LAG_S after it completed; what the bound releases leaves in writes of one token,
    back to back."""
    sizes = [10] * 20
    passes = word_passes(sizes, 0.05)
    events, _ = run_clocked(passes, 1, rate=4.0)
    assert all(u == 1 for _, u, _ in events[:-1])
    assert sum(a == b for (a, *_), (b, *_) in itertools.pairwise(events)) > 10, "no catch-up"
    released_at = [t for t, u, _ in events for _ in range(u)]
    # token i (0-based) completes with the pass after the one that wrote it (units.py), or at the end
    for i, t in enumerate(released_at):
        done = passes[min(i // 10 + 1, len(sizes))][0]
        assert t - done <= clocked_module.MAX_LAG_S + 1e-9, (i, t, done)
    out = [c for *_, g in events for c in g]
    assert "".join(c.delta_text for c in out) == "".join(c.delta_text for _, c in passes)


@pytest.mark.parametrize("n, tokens", [(1, 5), (4, 5), (4, 20), (3, 30), (4, 27)])
def test_padded_length_gives_every_reply_the_same_writes_and_end(n, tokens):
    """+pad to 20: a reply of 5 units and one of 20 leave in as many writes, at the same times, the
    end last; the units first, then fillers (empty writes). A reply of more units than its budget of
    tokens (a text that cuts finer than its tokens, "'s") is not cut: its last write holds the rest,
    and the count of writes is the budget's all the same."""
    events, _ = run_clocked(word_passes([1] * tokens, 0.01), n, rate=40.0, pad_to=20)
    full, _ = run_clocked(word_passes([1] * 20, 0.01), n, rate=40.0, pad_to=20)
    assert [t for t, *_ in events] == [t for t, *_ in full]
    writes = -(-20 // n)
    assert len(events) == writes + 1 and events[-1][2][-1].usage == Usage.of(3, tokens)
    assert sum(u for _, u, _ in events) == tokens
    counts = [u for _, u, _ in events[:-1]]
    assert events[-1][1] == 0  # the end
    if tokens <= 20:  # units, then fillers
        assert counts == sorted(counts, reverse=True)
        assert [g for _, u, g in events[:-1] if u == 0] == [[]] * (writes - -(-tokens // n))
    else:
        assert counts == [n] * (writes - 1) + [tokens - n * (writes - 1)]
    out = [c for *_, g in events for c in g]
    assert "".join(c.delta_text for c in out) == "".join(c.delta_text for _, c in word_passes([1] * tokens, 0.01))
    _on_grid([t for t, *_ in events], n / 40.0)


def test_padded_length_holds_when_the_lag_bound_releases_the_end():
    """The engine far ahead of the clock (the lag bound releases the groups, the last among them):
    the end is still padded to the budget (found on the loaded machine: the end left by the bound,
    unpadded)."""
    passes = word_passes([10] * 20, 0.05)
    events, _ = run_clocked(passes, 2, rate=4.0, pad_to=256)
    assert len(events) == 128 + 1 and sum(u for _, u, _ in events) == 200
    assert events[-1][2][-1].usage == Usage.of(3, 200) and events[-1][1] == 0
    assert [u for _, u, _ in events[:-1]] == [2] * 100 + [0] * 28


def test_padded_length_without_a_budget_rounds_up_to_a_power_of_two():
    events, _ = run_clocked(word_passes([1] * 20, 0.01), 4, rate=40.0, pad_to=0)
    assert len(events) == 32 // 4 + 1 and sum(u for _, u, _ in events) == 20


def test_clock_rates_lie_on_a_grid_below_the_recent_rate():
    assert clock_rate(100.0) <= clocked_module.RATE_MARGIN * 100.0
    assert clock_rate(100.0) > clocked_module.RATE_MARGIN * 100.0 / 2 ** (1 / clocked_module.RATE_STEPS)
    assert clock_rate(100.0) == clock_rate(101.0)  # the EMA's drift does not move the grid
    assert clock_rate(0.0) == 1.0


def test_the_clock_holds_its_grid_point_until_the_rate_leaves_it():
    """An EMA near a grid point flips between two points stream by stream; the clock holds the point it
    ran at unless the rate falls below it (at once) or rises HOLD_STEPS points above it."""
    step = 2 ** (1 / clocked_module.RATE_STEPS)
    held = clock_rate(100.0)
    just_above = held * step * 1.01 / clocked_module.RATE_MARGIN  # one grid point up
    assert clock_rate(just_above) == pytest.approx(held * step)  # unheld, it would move
    assert clock_rate(just_above, held) == held
    assert clock_rate(100.0 / step, held) == pytest.approx(held / step)  # slower: down at once
    two_up = held * step**clocked_module.HOLD_STEPS * 1.01 / clocked_module.RATE_MARGIN
    assert clock_rate(two_up, held) == pytest.approx(held * step**clocked_module.HOLD_STEPS)


def clock_rates_used(monkeypatch) -> list[float]:
    """The rate each stream `released` starts from here on is clocked at, in order."""
    from openalice_runner.server.release import stream as stream_module

    used: list[float] = []
    real = stream_module.clocked

    def spy(groups, n, rate, clock, **kwargs):
        used.append(rate)
        return real(groups, n, rate, clock, **kwargs)

    monkeypatch.setattr(stream_module, "clocked", spy)
    return used


def test_released_clocks_a_tenant_at_the_rate_it_holds(monkeypatch):
    """A tenant's streams run at the held point while its recent rate flickers one point above it,
    and the point each ran at is what the next is held to."""
    from openalice_runner.server.release import stream as stream_module

    used = clock_rates_used(monkeypatch)
    rates = PaceRates()
    key = "t\0m"
    step = 2 ** (1 / clocked_module.RATE_STEPS)
    low = clock_rate(1000.0)
    flicker = [1000.0, low * step * 1.01 / clocked_module.RATE_MARGIN, 1000.0, low * step * 1.01 / clocked_module.RATE_MARGIN]

    async def run():
        for recent in flicker:
            rates.recent[key] = deque([recent])  # what the streams before this one measured

            async def upstream():
                for _t, chunk in word_passes([2] * 3, 0.0):
                    yield chunk

            async for _group in stream_module.released(ReleaseMode("fixed", 2), upstream(), rates=rates,
                                                       rate_key=key):  # fmt: skip
                pass

    asyncio.run(run())
    assert used == [low] * 4 and rates.clocks[key] == low


def test_released_clocks_a_tenant_from_its_second_stream():
    """The first stream of a tenant and model leaves as produced and records its rate; the next is
    clocked at that rate's clock, every write on its grid."""
    from openalice_runner.server.release.stream import released

    rates = PaceRates()

    async def upstream(times):
        loop = asyncio.get_running_loop()
        for t, chunk in word_passes([2] * 12, 0.01):
            await asyncio.sleep(max(0.0, t - (loop.time() - times[0])))
            yield chunk

    async def run():
        out, seen = [], []
        for _ in range(2):
            seen.append(rates.rate("t\0m"))  # what the stream about to start is clocked from
            times: list[float] = [asyncio.get_running_loop().time()]
            stamps = []
            async for _group in released(ReleaseMode("fixed", 2), upstream(times), rates=rates, rate_key="t\0m"):
                stamps.append(asyncio.get_running_loop().time() - times[0])
            out.append(stamps)
        return out, seen

    (first, second), (before_first, recent) = asyncio.run(run())
    assert before_first is None and recent is not None and recent > 0 and len(first) == len(second) == 12
    # a clock never lets a write out early: the last of 12 writes waits for its grid point on the
    # clock of the first stream's rate (as measured, however the machine's load made it come out)
    assert second[-1] >= (11 + clocked_module.LEAD_SLOTS) * 2 / clock_rate(recent) - 0.01


def test_a_padded_streams_headers_wait_for_the_next_tenth_of_a_second(monkeypatch):
    """_open_first with a start (the padded modes): the answer waits until the next multiple of
    HEAD_QUANTUM_S after the request; without one (pass) it does not wait."""
    import types
    from contextlib import asynccontextmanager

    from openalice_runner.server import pipeline

    slept: list[float] = []
    now = [10.0]

    async def sleep(seconds):
        slept.append(seconds)

    monkeypatch.setattr(pipeline, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(pipeline, "asyncio", types.SimpleNamespace(sleep=sleep))

    @asynccontextmanager
    async def opened():
        now[0] += 0.234  # the first chunk came 0.234 s after the request
        yield _stream([text("hi", first=True)])

    async def run(start):
        now[0] = 10.0
        _, first = await pipeline._open_first(opened(), start)
        return first

    assert asyncio.run(run(10.0)).delta_text == "hi"
    assert slept == [pytest.approx(0.3 - 0.234)]
    asyncio.run(run(None))
    assert len(slept) == 1
