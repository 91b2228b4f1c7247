"""Issue 34, finding 1: operator YAML that would cost the server its memory or its event loop.

An alias bomb or a recursive alias is refused at its FILE:LINE:COL in milliseconds; the policy and
providers watchers keep the last good config and apply the next valid edit; the providers watcher
parses off the event loop."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
from stand_ins.engines import tiny_engine

from openalice_runner.config_files import ConfigError, load_located
from openalice_runner.policies import PolicyError, PolicyStore
from openalice_runner.policies.loader import load_policy_text

V1 = "rules:\n  - name: tools\n    match: {turn_type: tool_call}\n    method: ngram\n    gamma: 5\ndefault: {method: off}\n"
V2 = V1.replace("gamma: 5", "gamma: 7")


def bomb(levels: int, key: str = "x") -> str:
    """`levels` anchors, each a list of nine aliases of the one before: 9**levels values."""
    lines = [f"{key}0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"{key}{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


def write(path, text):
    path.write_text(text)
    st = path.stat()  # a later mtime even on a coarse clock
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def wait_for(condition, limit_s: float = 20.0) -> bool:
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_an_alias_bomb_is_refused_at_its_alias():
    # 9**6 = 531,441 values from ~300 bytes (the probe's 9**8 is refused the same way; 9**6 keeps
    # this test cheap on code without the limit, where it fails by parsing the whole bomb)
    text = bomb(6)
    assert len(text) < 400
    with pytest.raises(ConfigError) as info:
        load_located(text, "p.yaml", empty="x")
    problem = info.value.problems[0]
    assert (problem.line, problem.column) == (6, 10)  # the first *a4 of the largest list
    assert "alias *a4 repeats 66430 values" in problem.message and "more than the limit of 100000" in problem.message
    with pytest.raises(ConfigError, match="alias \\*a6 repeats"):
        load_located(bomb(8), "p.yaml", empty="x")


@pytest.mark.parametrize(
    ("text", "where"),
    [("a: &a [1, *a]\n", "p.yaml:1:11:"), ("x: &x\n  y: *x\n", "p.yaml:2:6:"), ("a: 1\nb: &b {c: [*b]}\n", "p.yaml:2:12:")],
)
def test_a_recursive_alias_is_reported_with_its_line_and_column(text, where):
    with pytest.raises(PolicyError) as info:
        load_policy_text(text, "p.yaml")
    assert str(info.value).startswith(where) and "recursive alias" in str(info.value)


def test_nesting_and_aliases_are_capped():
    with pytest.raises(ConfigError, match=r"p.yaml:1:65: .*nested more than 64 deep"):
        load_located("[" * 200 + "]" * 200, "p.yaml", empty="x")
    many = "a: &a 1\nb: [" + ", ".join(["*a"] * 1001) + "]\n"
    with pytest.raises(ConfigError, match="more than 1000 aliases"):
        load_located(many, "p.yaml", empty="x")
    ok = "a: &a {method: off}\nb: *a\n"  # ordinary anchors still work
    assert load_located(ok, "p.yaml", empty="x").data == {"a": {"method": "off"}, "b": {"method": "off"}}


def test_policy_watcher_refuses_a_bomb_and_applies_the_next_valid_edit(tmp_path):
    path = tmp_path / "policy.yaml"
    write(path, V1)
    store = PolicyStore.from_file(path, watch=True, poll_interval=0.05)
    try:
        first = store.version
        write(path, V1 + bomb(6, "y"))  # 531,441 values
        assert wait_for(lambda: store.last_error is not None, 10), "the bomb was not refused in time"
        assert "alias *a4 repeats" in str(store.last_error) and store.version == first
        write(path, V2)
        assert wait_for(lambda: store.version != first, 5), "the valid edit after the bomb did not apply"
        assert store.last_error is None and store.policy.rules[0].gamma == 7
    finally:
        store.stop_watching()


PROVIDERS = """providers:
  local: {type: local, tiny_random: true, max_tokens_default: 4}
routes:
  - {name: default, chain: [local]}
"""


async def test_providers_watcher_parses_off_the_loop_and_recovers_after_a_bomb(tmp_path, monkeypatch):
    from openalice_runner.providers import config as provider_config
    from openalice_runner.runner import Runner
    from openalice_runner.server.routing_watch import RoutingWatcher

    path = tmp_path / "providers.yaml"
    write(path, PROVIDERS)
    runner = Runner.from_config(str(path), policy=False, engine=tiny_engine(), telemetry=False)
    parsed_on: list[threading.Thread] = []
    real = provider_config.load_routing_text  # the watcher reads the file once, then parses its text

    def recording(*args, **kwargs):
        parsed_on.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(provider_config, "load_routing_text", recording)
    watcher = RoutingWatcher(runner, path, interval_s=0.05)
    task = asyncio.create_task(watcher.run())
    try:
        before = runner.routing
        write(path, PROVIDERS + bomb(6, "y"))
        for _ in range(400):
            if watcher.last_error:
                break
            await asyncio.sleep(0.01)
        assert "alias *a4 repeats" in (watcher.last_error or ""), watcher.last_error
        assert runner.routing is before
        write(path, PROVIDERS.replace("max_tokens_default: 4", "max_tokens_default: 5"))
        for _ in range(400):
            if watcher.last_error is None:
                break
            await asyncio.sleep(0.01)
        assert watcher.last_error is None and runner.routing is not before
        assert parsed_on and threading.main_thread() not in parsed_on  # never on the loop's thread
    finally:
        task.cancel()
        await runner.aclose()
