"""Hot reload: a valid edit is swapped in, a broken one leaves the old version in force."""

from __future__ import annotations

import os
import threading
import time

import pytest

from openalice_runner.policies import PolicyError, PolicyStore, RequestContext

V1 = "rules:\n  - name: tools\n    match: {turn_type: tool_call}\n    method: ngram\n    gamma: 5\ndefault: {method: off}\n"
V2 = V1.replace("gamma: 5", "gamma: 7")
BROKEN = V1.replace("gamma: 5", "gamma: lots")


def write(path, text):
    path.write_text(text)
    st = path.stat()  # bump mtime explicitly: coarse clocks could hide a fast rewrite
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def ctx():
    return RequestContext("tool_call", 1, "local")


def test_from_file_raises_positioned_error(tmp_path):
    p = tmp_path / "p.yaml"
    write(p, BROKEN)
    with pytest.raises(PolicyError) as info:
        PolicyStore.from_file(p)
    assert str(info.value.problems[0]).startswith(f"{p}:5:12: rules[0].gamma")
    with pytest.raises(PolicyError, match="cannot read policy file"):
        PolicyStore.from_file(tmp_path / "missing.yaml")


def test_reload_swaps_valid_and_keeps_last_good_on_broken(tmp_path):
    p = tmp_path / "p.yaml"
    write(p, V1)
    store = PolicyStore.from_file(p)
    v1 = store.version
    assert not store.reload_if_changed()  # unchanged
    write(p, BROKEN)
    assert not store.reload_if_changed()
    assert store.version == v1 and store.decide(ctx()).gamma == 5
    assert store.last_error is not None and ":5:12:" in str(store.last_error)
    write(p, V2)
    assert store.reload_if_changed()
    d = store.decide(ctx())
    assert d.gamma == 7 and d.policy_version == store.version != v1
    assert store.last_error is None
    p.unlink()  # a vanished file is reported too, and the policy stays
    assert not store.reload_if_changed()
    assert store.decide(ctx()).gamma == 7 and "cannot read" in str(store.last_error)


def test_adaptive_estimates_survive_a_reload(tmp_path):
    from openalice_runner.speculation import SpeculationOutcome

    p = tmp_path / "p.yaml"
    write(p, V1)
    store = PolicyStore.from_file(p)
    outcome = SpeculationOutcome(gamma=2, proposed=4, accepted=4, accept_length_histogram=(0, 0, 2))
    store.observe("chat", "ngram", "local", outcome)
    write(p, V2)
    assert store.reload_if_changed()
    assert store.adaptive.snapshot()["alpha"]


def test_watcher_picks_up_changes_and_survives_broken_files(tmp_path):
    p = tmp_path / "p.yaml"
    write(p, V1)
    store = PolicyStore.from_file(p, watch=True, poll_interval=0.05)
    try:
        assert store.watching
        write(p, BROKEN)
        _wait(lambda: store.last_error is not None)
        assert store.decide(ctx()).gamma == 5
        write(p, V2)
        _wait(lambda: store.decide(ctx()).gamma == 7)
        assert store.last_error is None
    finally:
        store.stop_watching()
    assert not store.watching


def test_decisions_during_concurrent_reloads_are_always_whole(tmp_path):
    p = tmp_path / "p.yaml"
    write(p, V1)
    store = PolicyStore.from_file(p)
    seen: set[tuple[int, str]] = set()
    stop = threading.Event()

    def decide_loop():
        while not stop.is_set():
            d = store.decide(ctx())
            seen.add((d.gamma, d.policy_version))

    t = threading.Thread(target=decide_loop)
    t.start()
    try:
        for text in (V2, BROKEN, V1, V2):
            write(p, text)
            store.reload_if_changed()
    finally:
        stop.set()
        t.join()
    versions = {}
    for gamma, version in seen:
        versions.setdefault(version, set()).add(gamma)
    assert all(len(g) == 1 for g in versions.values())  # a version never mixes decisions


def test_decide_never_raises(monkeypatch):
    store = PolicyStore.from_text(V1)

    def boom(*a, **k):
        raise RuntimeError("bug")

    monkeypatch.setattr(type(store.compiled), "decide", boom)
    d = store.decide(ctx())
    assert (d.method, d.gamma, d.rule) == ("off", 0, "error") and "bug" in d.reason


def _wait(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting for the watcher"
        time.sleep(0.02)
