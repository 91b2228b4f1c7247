"""bench/side_channel: the observer's classifier, the writes it sees, and a run through real `serve`
processes (tiny random model): padded modes show only bucket sizes and change no output."""

from __future__ import annotations

import pytest

from openalice_runner.bench.side_channel import fingerprint
from openalice_runner.bench.side_channel.classify import accuracy, loo_accuracy
from openalice_runner.bench.side_channel.observe import Observation, writes

TINY = "providers:\n  local: {type: local, tiny_random: true}\nroutes:\n  - {name: default, chain: [local]}\n"


def _obs(label: int, sizes: list[int], gap: float = 0.01) -> Observation:
    return Observation(label, "m", "ngram", 0.0, reads=[(gap * (i + 1), n) for i, n in enumerate(sizes)])


def test_streams_that_differ_by_prompt_are_told_apart_and_alike_ones_score_chance():
    told = [_obs(k, [100 + 40 * k, 60, 60 + 10 * k]) for k in range(4) for _ in range(3)]
    assert accuracy(told, "sizes") == 1.0
    alike = [_obs(k, [1024, 1024, 1024]) for k in range(4) for _ in range(3)]
    # every other stream ties: 2 of the 11 answered the same prompt
    assert accuracy(alike, "sizes") == pytest.approx(2 / 11)
    assert accuracy(alike, "both") == pytest.approx(2 / 11)
    # timing alone: the same sizes, a different pace per prompt
    paced = [_obs(k, [1024] * 3, gap=0.01 * (k + 1)) for k in range(4) for _ in range(3)]
    assert accuracy(paced, "timing") == 1.0 and accuracy(paced, "sizes") == pytest.approx(2 / 11)


def test_a_noisy_observer_is_scored_by_its_nearest_neighbour():
    rows = [[0.0], [0.1], [5.0], [5.1], [0.2]]
    # right, a tie between labels 0 and 1 (half), right, right, wrong (0.2 is nearest to 0.1)
    assert loo_accuracy(rows, [0, 0, 1, 1, 1]) == pytest.approx(3.5 / 5)


def test_writes_are_events_unpadded_and_comment_led_groups_padded():
    event = b'data: {"x": 1}\n\n'
    assert writes([(0.1, event), (0.1, event), (0.2, event)]) == [(0.1, len(event))] * 2 + [(0.2, len(event))]
    pad = b":" + b" " * 1000 + b"\n\n"
    assert writes([(0.1, pad), (0.1, event), (0.1, event), (0.3, pad), (0.35, event)]) == [
        (0.1, len(pad) + 2 * len(event)), (0.35, len(pad) + len(event))]


def test_a_run_through_serve_changes_no_output_and_pads_every_write_to_a_bucket(tmp_path):
    """Real `serve` processes under `pass` and `fixed:4`: the same greedy text, and the observer
    sees only bucket sizes from the padded one (one write per 4 tokens), any size from `pass`."""
    from openalice_runner.server.release.padding import bucket

    providers = tmp_path / "tiny.yaml"
    providers.write_text(TINY)
    report = fingerprint.run(fingerprint.PROMPTS[:2], repeats=2, modes=("pass", "fixed:4"), methods=("ngram",),
                             temperatures=(0.0,), max_tokens=12, providers=str(providers), log=lambda _: None)
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"pass", "fixed:4"} and all(r["streams"] == 4 for r in rows.values())
    assert report["same_output_as_pass"] == {"fixed:4": "4/4"}
    assert report["chance"] == 0.5 and set(report["summary"]["meets_bar"]) == {"pass", "fixed:4"}
    for row in rows.values():
        assert set(row["accuracy"]) == {"sizes", "timing", "both"}
    assert rows["fixed:4"]["write_sizes"] and all(n == bucket(n) for n in rows["fixed:4"]["write_sizes"])
    assert any(n != bucket(n) for n in rows["pass"]["write_sizes"])
    assert rows["pass"]["reads_per_stream_p50"] > rows["fixed:4"]["reads_per_stream_p50"]


def test_cross_tenant_summary_calls_isolation_only_when_b_drafts_as_an_empty_store_and_finds_no_prefix():
    from openalice_runner.bench.side_channel.cross_tenant import format_table, summary

    def row(b_accepted, b_cached):
        call = {"completion_tokens": 40, "cached_tokens": 0, "text": "t"}
        return {"prompt": 0, "writer": {**call, "accepted": 5}, "other_tenant": {**call, "accepted": b_accepted},
                "fresh_tenant": {**call, "accepted": 5}, "same_tenant": {**call, "accepted": 30}, "same_text": True,
                "follow_up_cached": {"other_tenant": b_cached, "same_tenant": 90}}

    isolated = summary([row(5, 0), row(5, 0)])
    assert isolated["isolated"] and isolated["accepted"] == {"other_tenant": 10, "fresh_tenant": 10, "same_tenant": 60}
    assert isolated["leaked_share"] == 0 and isolated["follow_up_cached_tokens"] == {"other_tenant": 0, "same_tenant": 180}
    assert summary([row(6, 0), row(5, 0)])["isolated"]  # a draft length's noise: 1 of a 50-token gain
    assert not summary([row(5, 0), row(30, 0)])["isolated"]  # b drafted from a's reply
    assert summary([row(5, 0), row(30, 0)])["leaked_share"] == 0.5
    assert not summary([row(5, 64), row(5, 0)])["isolated"]  # b found a's prefix
    assert "| 0 | 40 | 5 | 5 | 30 | 0 | 90 |" in format_table({"rows": [row(5, 0)], "summary": isolated})
