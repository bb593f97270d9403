"""The import graph of harness/ runs one way: each module imports only its own layer and the ones
below it (LAYERS, declared once here and drawn in docs/architecture.md), lazy imports included,
and no two modules import each other, directly or round a longer circle.

A module belongs to the layer that names it, else to the layer of the longest package ("pkg.") it is
in: `harness.checkpoint` alone is that package's face (what `run/` and the commands import), above
its rooms (`harness.checkpoint.`) and its save rooms (`harness.checkpoint.save.`).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[tuple[str, ...]] = [
    ("optim.",),
    ("harness.exit_codes", "harness.errors", "harness.topology", "harness.log", "harness.config_layers",
     "harness.config."),
    ("harness.storage.", "harness.records."),
    ("harness.checkpoint.",),
    ("harness.repro.", "harness.models.", "harness.health.", "harness.process."),
    ("harness.parallel.",),
    ("harness.data.", "harness.task."),
    ("harness.checkpoint.save.",),
    ("harness.checkpoint", "harness.export."),
    ("harness.run.",),
    ("harness.verify.", "harness.experiments."),
    ("harness", "harness.__main__", "harness.testing", "harness.cli.", "harness.forkserver."),
    # The fork server's own process runs the CLI (it preloads its command modules, its children run
    # it); the CLI asks a server through the package's client side (relay, pool) a floor below.
    ("harness.forkserver.server", "harness.forkserver.child", "harness.forkserver.__main__"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in ("harness", "optim") for p in (ROOT / pkg).rglob("*.py")}


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in its body (`from a import b` names a.b when
    that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                found.add(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module)
    return {m for m in found if m in known}


def layer(module: str) -> int:
    """A name without a trailing dot is one module; "pkg." is the package and everything in it."""
    exact = [i for i, names in enumerate(LAYERS) if module in names]
    if exact:
        return exact[0]
    best, where = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            if name.endswith(".") and (module + ".").startswith(name) and len(name) > best:
                best, where = len(name), i
    assert where is not None, f"{module} is in no layer: add it to LAYERS"
    return where


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(p, set(mods)) - {m} for m, p in mods.items()}


def test_every_import_runs_down_or_across():
    upward = [f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
              for m, deps in sorted(graph().items()) for d in sorted(deps) if layer(d) > layer(m)]
    assert upward == []


def test_no_circle():
    g = graph()
    circles, state = [], {}

    def visit(m: str, trail: list[str]) -> None:
        state[m] = "open"
        for d in sorted(g[m]):
            if state.get(d) == "open":
                circles.append(" -> ".join(trail[trail.index(d):] + [d]))
            elif d not in state:
                visit(d, trail + [d])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert circles == []


def test_the_package_root_holds_only_entry_points_and_the_ground_floor():
    flat = sorted(p.stem for p in (ROOT / "harness").glob("*.py"))
    assert flat == ["__init__", "__main__", "config_layers", "errors", "exit_codes", "log", "testing", "topology"]


def test_run_imports_only_the_checkpoint_face():
    """run/ saves and resumes through `harness.checkpoint` alone, whatever the strategy and tier."""
    rooms = [f"{m} imports {d}" for m, deps in sorted(graph().items()) if m.startswith("harness.run.")
             for d in sorted(deps) if d.startswith("harness.checkpoint.")]
    assert rooms == []
