"""Import floors: which parts of the package may load torch, transformers and the embedded engine.

The sidecar, the policy, the routing file, tracing and the SGLang / hosted providers must run where
torch is not installed, and importing them must not pay for it. Only the engine side (the engine,
offline EAGLE training, the benchmarks, the local provider and the engine CLI commands) may import
torch, transformers, `openalice_runner.engine` or `openalice_runner.training`, and nothing else may,
not even lazily inside a function. A few layering rules ride along (the engine does not reach up
into the benchmarks or the server, tracing does not know providers, ...).

Every module's source is read with `ast`: `import` and `from ... import` anywhere in the file
(inside functions too), and `importlib.import_module("...")` / `__import__("...")` with a literal
name. A second check follows the imports that run at import time (outside functions) through the
package, so that a floor module cannot load torch by importing an engine-side module at top level;
a subprocess then imports every floor module for real and looks at `sys.modules`.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import openalice_runner

PACKAGE = "openalice_runner"
PACKAGE_DIR = Path(openalice_runner.__file__).parent

HEAVY = ("torch", "transformers", f"{PACKAGE}.engine", f"{PACKAGE}.training")

# The engine side: the only modules that may import HEAVY. Listed one by one outside the three packages.
ENGINE_SIDE_PACKAGES = (f"{PACKAGE}.engine", f"{PACKAGE}.training", f"{PACKAGE}.bench")
ENGINE_SIDE_MODULES = frozenset({
    f"{PACKAGE}.providers.local",  # the embedded engine as a provider (loaded only for `type: local`)
    f"{PACKAGE}.cli.generate",
    f"{PACKAGE}.cli.bench",
    f"{PACKAGE}.cli.bench_concurrency",
    f"{PACKAGE}.cli.bench_follow_up",
    f"{PACKAGE}.cli.bench_constrained",
    f"{PACKAGE}.cli.draft",
    f"{PACKAGE}.cli.common",  # load_engine(), called only by the engine commands above
})


@dataclass(frozen=True)
class Floor:
    name: str
    importers: tuple[str, ...]  # modules under these prefixes ...
    forbidden: tuple[str, ...]  # ... never import these
    engine_side_exempt: bool = False  # True: ENGINE_SIDE modules are not bound by it


FLOORS = (
    Floor("torch floor", (PACKAGE,), HEAVY, engine_side_exempt=True),
    Floor(
        "engine layering",
        (f"{PACKAGE}.engine",),
        (f"{PACKAGE}.bench", f"{PACKAGE}.training", f"{PACKAGE}.server", f"{PACKAGE}.runner", f"{PACKAGE}.cli"),
    ),
    Floor("tracing layering", (f"{PACKAGE}.tracing",),
          (f"{PACKAGE}.providers", f"{PACKAGE}.server", f"{PACKAGE}.runner")),  # fmt: skip
    Floor("policies layering", (f"{PACKAGE}.policies",),
          (f"{PACKAGE}.providers", f"{PACKAGE}.server", f"{PACKAGE}.runner")),  # fmt: skip
)

# Crossings tolerated while they are being removed, as (importer, imported). Empty since the engine's
# SpecConfig / GenerationStats vocabulary moved to the torch-free openalice_runner/speculation.py (it held
# types.SamplingSettings.to_engine, policies.decision.Decision.to_spec_config and providers.pools.sglang's
# GenerationStats). Never add one for new code: a new crossing is a bug. A listed one that is gone fails too.
KNOWN_CROSSINGS: frozenset[tuple[str, str]] = frozenset()


@dataclass(frozen=True)
class Import:
    names: tuple[str, ...]  # what it may load: `from a.b import c` -> ("a.b", "a.b.c")
    line: int
    at_import_time: bool  # outside any function: runs when the module is imported


@dataclass(frozen=True)
class Crossing:
    floor: str
    importer: str
    imported: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} imports {self.imported} ({self.floor})"


# ---- reading imports ---------------------------------------------------------------------------------


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def is_engine_side(module: str) -> bool:
    return module in ENGINE_SIDE_MODULES or _under(module, ENGINE_SIDE_PACKAGES)


class _ImportReader(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.depth = 0  # functions entered
        self.found: list[Import] = []

    def _add(self, names: tuple[str, ...], node: ast.AST) -> None:
        self.found.append(Import(names, node.lineno, self.depth == 0))

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add((alias.name,), node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            parts = self.package.split(".")
            base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        self._add((base, *(f"{base}.{a.name}" for a in node.names if a.name != "*")), node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if called in ("import_module", "__import__") and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and not first.value.startswith("."):
                self._add((first.value,), node)
        self.generic_visit(node)


def imports_of(module: str, source: str, is_package: bool = False) -> list[Import]:
    reader = _ImportReader(module, is_package)
    reader.visit(ast.parse(source))
    return reader.found


def package_sources(root: Path = PACKAGE_DIR) -> dict[str, tuple[str, bool]]:
    """module name -> (source, is_package) for every .py file of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        out[name] = (path.read_text(encoding="utf-8"), is_package)
    return out


# ---- the checks ----------------------------------------------------------------------------------------


def direct_crossings(module: str, source: str, is_package: bool = False) -> list[Crossing]:
    """Imports anywhere in `module` (functions included) that cross a floor."""
    found = []
    for imp in imports_of(module, source, is_package):
        for floor in FLOORS:
            if not _under(module, floor.importers) or (floor.engine_side_exempt and is_engine_side(module)):
                continue
            hit = next((n for n in imp.names if _under(n, floor.forbidden)), None)
            if hit is not None:
                found.append(Crossing(floor.name, module, _forbidden_prefix_or(hit, imp.names[0], floor), imp.line))
    return found


def _forbidden_prefix_or(hit: str, base: str, floor: Floor) -> str:
    # report `from openalice_runner.engine.types import X` as the module, not X
    return base if _under(base, floor.forbidden) else hit


def import_time_chains(sources: dict[str, tuple[str, bool]]) -> dict[str, list[str]]:
    """Floor module -> the chain of top-level imports through which importing it loads a HEAVY module."""
    graph: dict[str, list[str]] = {}
    for module, (source, is_package) in sources.items():
        edges = []
        for imp in imports_of(module, source, is_package):
            if not imp.at_import_time:
                continue
            for name in imp.names:
                if _under(name, HEAVY):
                    edges.append(name)
                    continue
                # importing a.b.c runs a/__init__, a/b/__init__ and a/b/c
                parts = name.split(".")
                edges += [m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in sources]
        graph[module] = edges

    chains = {}
    for start in sources:
        if is_engine_side(start):
            continue
        parent: dict[str, str | None] = {start: None}
        queue = [start]
        while queue:
            current = queue.pop(0)
            if _under(current, HEAVY):
                chain = [current]
                while parent[chain[-1]] is not None:
                    chain.append(parent[chain[-1]])
                chains[start] = chain[::-1]
                break
            for nxt in graph.get(current, []):
                if nxt not in parent:
                    parent[nxt] = current
                    queue.append(nxt)
    return chains


# ---- tests --------------------------------------------------------------------------------------------


def test_no_module_crosses_a_floor():
    sources = package_sources()
    assert f"{PACKAGE}.runner" in sources and f"{PACKAGE}.engine.engine" in sources  # the walk found the package
    crossings = [c for m, (src, pkg) in sources.items() for c in direct_crossings(m, src, pkg)]
    new = [c for c in crossings if (c.importer, c.imported) not in KNOWN_CROSSINGS]
    assert not new, "new floor crossings:\n" + "\n".join(map(str, new))
    stale = KNOWN_CROSSINGS - {(c.importer, c.imported) for c in crossings}
    assert not stale, f"these crossings are gone: delete them from KNOWN_CROSSINGS: {sorted(stale)}"


def test_engine_side_listed_modules_exist():
    # a renamed engine command must not leave a stale exemption behind
    sources = package_sources()
    assert sources.keys() >= ENGINE_SIDE_MODULES, ENGINE_SIDE_MODULES - sources.keys()


def test_importing_a_floor_module_loads_no_engine_module_at_import_time():
    chains = import_time_chains(package_sources())
    assert not chains, "\n".join(f"{m}: {' -> '.join(chain)}" for m, chain in sorted(chains.items()))


def test_importing_every_floor_module_leaves_torch_unloaded():
    """The real counterpart of the static check: import them all in a fresh interpreter."""
    floor_modules = [m for m in package_sources() if not is_engine_side(m) and m != f"{PACKAGE}.__main__"]
    script = (
        "import importlib, json, sys\n"
        f"for m in {floor_modules!r}: importlib.import_module(m)\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
        f"or m.startswith(({HEAVY[2]!r}, {HEAVY[3]!r})))))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [], f"importing the floor modules loaded: {loaded[:10]}"


# ---- the checker itself: it must flag what it is meant to flag ---------------------------------------


def test_checker_flags_torch_imported_inside_a_function():
    source = "def encode(x):\n    import torch\n\n    return torch.tensor(x)\n"
    crossings = direct_crossings(f"{PACKAGE}.policies.fake", source)
    assert [(c.floor, c.imported, c.line) for c in crossings] == [("torch floor", "torch", 2)]
    # the same source is fine on the engine side
    assert direct_crossings(f"{PACKAGE}.engine.fake", source) == []
    assert direct_crossings(f"{PACKAGE}.providers.local", source) == []


def test_checker_flags_every_import_form():
    cases = {
        "from openalice_runner.engine.types import SpecConfig": f"{PACKAGE}.engine.types",
        "from openalice_runner import engine": f"{PACKAGE}.engine",
        "from .. import training": f"{PACKAGE}.training",  # relative, from openalice_runner.server.fake
        "import transformers.models": "transformers.models",
        "import importlib\nimportlib.import_module('torch')": "torch",
        "class A:\n    def f(self):\n        return __import__('transformers')": "transformers",
    }
    for source, imported in cases.items():
        crossings = direct_crossings(f"{PACKAGE}.server.fake", source)
        assert [c.imported for c in crossings] == [imported], source


def test_checker_flags_layering():
    assert [c.floor for c in direct_crossings(f"{PACKAGE}.tracing.fake", "from openalice_runner.providers import base")] == [
        "tracing layering"
    ]
    assert [c.floor for c in direct_crossings(f"{PACKAGE}.policies.fake", "import openalice_runner.runner")] == [
        "policies layering"
    ]
    assert [c.floor for c in direct_crossings(f"{PACKAGE}.engine.fake", "def f():\n    import openalice_runner.bench.workload")] == [
        "engine layering"
    ]
    assert direct_crossings(f"{PACKAGE}.training.fake", "from openalice_runner.bench.workload import Case") == []


def test_checker_follows_top_level_imports_through_the_package():
    sources = {
        PACKAGE: ("", True),
        f"{PACKAGE}.config": ("from openalice_runner.local import EmbeddedConfig\n", False),
        f"{PACKAGE}.local": ("from openalice_runner.engine.types import X\n", False),
        f"{PACKAGE}.lazy": ("def f():\n    from openalice_runner.local import EmbeddedConfig\n", False),
    }
    chains = import_time_chains(sources)
    assert chains == {
        f"{PACKAGE}.config": [f"{PACKAGE}.config", f"{PACKAGE}.local", f"{PACKAGE}.engine.types"],
        f"{PACKAGE}.local": [f"{PACKAGE}.local", f"{PACKAGE}.engine.types"],
    }
