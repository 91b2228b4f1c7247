"""Packaging: the wheel carries the default policy and routing, and its core runs without torch.

The wheel is built from a copy of the package sources and installed (without dependencies) into fresh
venvs under tmp_path, away from the checkout; scripts run there with their cwd outside the checkout.
Dependencies come from this venv's installed distributions, so nothing is downloaded:

- the full venv gets a .pth line naming this interpreter's site-packages. A plain path line does not
  run that directory's own .pth files, so the editable finder pointing at the checkout is not
  installed and the wheel's copy of openalice_runner is the one imported (asserted);
- the core venv gets, linked file by file into its own site-packages as pip would have installed them,
  exactly the distributions that the wheel's core requirements plus its [hosted] extra resolve to
  (markers and extras evaluated from the installed metadata). torch, transformers and numpy are not
  hidden by an import hook there: they are not installed, so `find_spec("torch")` is None exactly as
  on a user's machine. A core requirement missing from pyproject.toml would show up as an import error.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import yaml
from locations import REPO
from packaging.requirements import Requirement
from stand_ins.openai_server import OpenAIStandIn
from stand_ins.serve import refused_url

from openalice_runner.policies import PolicyStore
from openalice_runner.policies.loader import content_version
from openalice_runner.providers.config import RoutingConfig, RoutingConfigError, load_routing_text

SHIPPED = {  # package data -> the operators' editable copy at the top of the repository
    "openalice_runner/defaults/policy.yaml": "policies/default.yaml",
    "openalice_runner/defaults/providers.yaml": "providers/default.yaml",
}
ENGINE_EXTRA = "needs the engine extra: pip install 'openalice-runner[engine]'"


@pytest.mark.parametrize("shipped", sorted(SHIPPED))
def test_shipped_defaults_are_the_top_level_files(shipped):
    assert (REPO / shipped).read_bytes() == (REPO / SHIPPED[shipped]).read_bytes(), (
        f"{shipped} and {SHIPPED[shipped]} differ: edit both (the package ships the first)"
    )


# ---- a `local` provider without the engine extra ----


@pytest.fixture
def without_torch(monkeypatch):
    """The routing loader's detection sees no torch (it finds, never imports: see the core venv test)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **kw: None if name == "torch" else real(name, *a, **kw)
    )


ROUTES = """\
providers:
  cloud: {type: hosted, model: openai/gpt-4o-mini}
  gpu:
    type: sglang
    model: m
    pools: {plain: {replicas: ["http://127.0.0.1:30000"]}}
  cpu:
    type: local
routes:
  - name: default
    chain: [gpu, cloud, cpu]
"""


def test_local_provider_without_torch_fails_at_load_naming_the_extra(without_torch):
    with pytest.raises(RoutingConfigError) as err:
        load_routing_text(ROUTES, "routes.yaml")
    assert [str(p) for p in err.value.problems] == [f"routes.yaml:8:11: provider 'cpu' {ENGINE_EXTRA}"]
    with pytest.raises(RoutingConfigError, match=re.escape(f"provider 'local' {ENGINE_EXTRA}")):
        RoutingConfig.default()


def test_sglang_and_hosted_routes_load_without_torch(without_torch):
    text = ROUTES.replace("  cpu:\n    type: local\n", "").replace(", cpu]", "]")
    config = load_routing_text(text, "routes.yaml")
    assert sorted(config.providers) == ["cloud", "gpu"]


def test_local_provider_loads_with_torch():
    assert load_routing_text(ROUTES, "routes.yaml").providers["cpu"].type == "local"


# ---- building and installing the wheel ----


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(
        REPO / "openalice_runner", src / "openalice_runner", ignore=shutil.ignore_patterns("__pycache__")
    )
    out = tmp_path_factory.mktemp("wheel")
    # With the venv's own setuptools when it has one (no download); else pip fetches it, as setup.sh's install did.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", out, src])
    (built,) = out.glob("openalice_runner-*.whl")
    return built


def _venv(root: Path, wheel: Path) -> tuple[Path, Path]:
    """A fresh venv with only the wheel installed: (its python, its site-packages)."""
    _run([sys.executable, "-m", "venv", "--without-pip", root])
    python = root / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
          "--disable-pip-version-check", wheel])  # fmt: skip
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    return python, Path(purelib)


def _run(cmd: list, cwd: Path | None = None, env: dict | None = None) -> str:
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{cmd} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _script(python: Path, cwd: Path, code: str, **env: str) -> dict:
    """Run `code` in the venv with cwd outside the checkout; it prints one JSON object last."""
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    out = _run([python, "-c", textwrap.dedent(code)], cwd=cwd, env={**clean, **env})
    return json.loads(out.strip().splitlines()[-1])


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _resolve(requirements: list[Requirement]) -> tuple[list[md.Distribution], list[str]]:
    """The installed distributions these requirements pull in, transitively; and those not installed."""
    extras_of: dict[str, set[str]] = {}
    dists: dict[str, md.Distribution] = {}
    missing: list[str] = []
    todo = list(requirements)
    while todo:
        req = todo.pop()
        name = _canonical(req.name)
        if name in extras_of and set(req.extras) <= extras_of[name]:
            continue
        try:
            dist = dists.get(name) or md.distribution(req.name)
        except md.PackageNotFoundError:
            missing.append(str(req))
            continue
        dists[name] = dist
        extras_of[name] = extras_of.get(name, set()) | set(req.extras)
        for sub in map(Requirement, dist.requires or []):
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in {"", *extras_of[name]}):
                todo.append(sub)
    return list(dists.values()), missing


def _link_installed(dists: list[md.Distribution], site: Path) -> None:
    """Link the files pip recorded for `dists` into `site`, as if pip had installed them there.

    A top-level entry that no other installed distribution shares is linked whole (fast); a shared
    one (a namespace package such as opentelemetry/, __pycache__/ of top-level modules) file by file.
    """
    owners: dict[str, set[str]] = {}
    for dist in md.distributions():
        name = _canonical(dist.metadata["Name"])
        for rel in dist.files or []:
            owners.setdefault(rel.parts[0], set()).add(name)
    for dist in dists:
        assert dist.files, f"{dist.metadata['Name']} has no RECORD: cannot tell which files are its own"
        base = Path(dist.locate_file(""))
        for rel in dist.files or []:
            if rel.parts[0] == ".." or rel.suffix == ".pth":  # scripts outside site-packages; startup hooks
                continue
            whole = len(owners[rel.parts[0]]) == 1 and len(rel.parts) > 1
            link = Path(rel.parts[0]) if whole else rel
            target = site / link
            if target.is_symlink() or target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(base / link)


@pytest.fixture(scope="module")
def full_venv(tmp_path_factory, wheel) -> Path:
    python, site = _venv(tmp_path_factory.mktemp("full"), wheel)
    (site / "parent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory, wheel) -> Path:
    python, site = _venv(tmp_path_factory.mktemp("core"), wheel)
    (installed,) = site.glob("openalice_runner-*.dist-info")
    requires = map(Requirement, md.PathDistribution(installed).requires or [])
    wanted = [r for r in requires if r.marker is None or r.marker.evaluate({"extra": "hosted"})]
    dists, missing = _resolve(wanted)
    assert not missing, f"core+hosted requirements not installed in this venv: {missing}"
    _link_installed(dists, site)
    return python


# ---- the wheel, installed with every extra ----


def test_wheel_runner_loads_the_shipped_default_policy(full_venv, tmp_path):
    got = _script(
        full_venv, tmp_path,
        """
        import json, sys
        import openalice_runner
        from openalice_runner import Runner

        runner = Runner.from_config()
        local = runner.providers["local"]
        print(json.dumps({
            "package": openalice_runner.__file__,
            "policy_path": str(runner.policy.path),
            "version": runner.policy.version,
            "policy": runner.policy.policy.model_dump(mode="json"),
            "routes": [r.name for r in runner.routing.routes],
            "providers": sorted(runner.providers),
            "engine_loaded": local._engine is not None,  # from_config is lazy: no model load
        }))
        """,
    )  # fmt: skip
    venv = full_venv.parents[1]
    assert Path(got["package"]).is_relative_to(venv), f"imported {got['package']}, not the wheel's copy"
    assert Path(got["policy_path"]).is_relative_to(venv)
    assert Path(got["policy_path"]).name == "policy.yaml"
    top = PolicyStore.from_file(REPO / "policies/default.yaml")
    assert got["version"] == top.version == content_version((REPO / "policies/default.yaml").read_bytes())
    assert got["policy"] == top.policy.model_dump(mode="json")
    assert got["policy"]["rules"], "the default policy has rules: speculation is on"
    assert (got["providers"], got["routes"]) == (["local"], ["default"])
    assert got["engine_loaded"] is False


# ---- the wheel with only its core and [hosted] dependencies: no torch ----


def _gpu_example_without_local(server_url: str) -> dict:
    data = yaml.safe_load((REPO / "providers/gpu-example.yaml").read_text())
    del data["providers"]["local"]
    for route in data["routes"]:
        route["chain"].remove("local")
    for pool in data["providers"]["gpu"]["pools"].values():  # nothing listens: the fallback moves on
        pool["replicas"] = [refused_url()]
    data["providers"]["gpu"]["api_key_env"] = "STAND_IN_API_KEY"
    data["providers"]["cloud"].update(api_base=server_url, api_key_env="STAND_IN_API_KEY", max_retries=0)
    return data


def _position_of_local_type(path: Path) -> tuple[int, int]:
    """Line and column of the `type` value of the `local:` provider entry in a routing file."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "local:")
    i = next(i for i in range(start + 1, len(lines)) if lines[i].strip().startswith("type:"))
    return i + 1, lines[i].index("local") + 1


def test_core_install_routes_to_sglang_and_hosted_without_torch(core_venv, tmp_path):
    example = tmp_path / "gpu-example.yaml"
    shutil.copy(REPO / "providers/gpu-example.yaml", example)
    without_local = tmp_path / "gpu-no-local.yaml"
    with OpenAIStandIn() as server:
        without_local.write_text(yaml.safe_dump(_gpu_example_without_local(server.url), sort_keys=False))
        got = _script(
            core_venv, tmp_path,
            """
            import asyncio, importlib.util, json, sys

            missing = {}
            for name in ("torch", "transformers", "numpy"):
                try:
                    __import__(name)
                    missing[name] = False
                except ModuleNotFoundError:
                    missing[name] = True

            import openalice_runner
            from openalice_runner import Runner
            from openalice_runner.providers.config import RoutingConfigError

            def load_error(*args):
                try:
                    Runner.from_config(*args, telemetry=False)
                except RoutingConfigError as exc:
                    return str(exc)
                return None

            async def serve():
                runner = Runner.from_config("gpu-no-local.yaml", telemetry=False)
                try:
                    async with runner.turn(conversation_id="c1", turn_type="chat", agent="alice") as turn:
                        r = await turn.chat([{"role": "user", "content": "hello there"}], max_tokens=2)
                    return {"provider": r.provider, "content": r.content, "providers": sorted(runner.providers)}
                finally:
                    await runner.aclose()

            print(json.dumps({
                "package": openalice_runner.__file__,
                "not_installed": missing,
                "torch_spec": importlib.util.find_spec("torch") is not None,
                "example_error": load_error("gpu-example.yaml"),
                "default_error": load_error(),
                "served": asyncio.run(serve()),
                "heavy_imported": sorted({"torch", "transformers", "numpy"} & set(sys.modules)),
            }))
            """,
            STAND_IN_API_KEY="sk-stand-in",
        )  # fmt: skip
        requests = list(server.requests)
    assert Path(got["package"]).is_relative_to(core_venv.parents[1])
    assert got["not_installed"] == {"torch": True, "transformers": True, "numpy": True}
    assert got["torch_spec"] is False and got["heavy_imported"] == []
    line, col = _position_of_local_type(example)
    assert got["example_error"] == f"gpu-example.yaml:{line}:{col}: provider 'local' {ENGINE_EXTRA}"
    line, col = _position_of_local_type(REPO / "openalice_runner/defaults/providers.yaml")
    assert got["default_error"] == f"openalice_runner/defaults/providers.yaml:{line}:{col}: provider 'local' {ENGINE_EXTRA}"
    assert got["served"] == {"provider": "cloud", "content": "You said:", "providers": ["cloud", "gpu"]}
    assert len(requests) == 1 and requests[0]["max_tokens"] == 2


def test_core_install_cli_uses_the_shipped_policy(core_venv, tmp_path):
    cli = core_venv.parent / "openalice-runner"
    out = _run([cli, "policy", "explain", "--turn-type", "tool_call", "--batch-size", "1", "--json"], cwd=tmp_path)
    decision = json.loads(out)
    top = PolicyStore.from_file(REPO / "policies/default.yaml")
    assert decision["policy_version"] == top.version and decision["method"] == "ngram"
