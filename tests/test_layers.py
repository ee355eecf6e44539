"""The layering the folders promise (docs/ARCHITECTURE.md), checked on the source.

* the layers read one way: every module imports only modules of its own layer or of the layers
  below it (:data:`LAYERS`, bottom first), at any level (inside functions and under
  ``TYPE_CHECKING`` too): a folder never imports a folder above it, so there is no folder loop
  (``training/ray`` below ``training/slime``, ``console`` below ``training`` and ``receiver``);
* no import loop among the modules of ``asyncsync`` and ``receiver`` (module-level imports);
* ``asyncsync/format/`` and ``asyncsync/codec/`` (the ground both sides stand on) import nothing
  of ``publish``, ``training``, ``ops`` or ``receiver``, at any level; ``format`` imports nothing
  of ``codec``; ``publish`` and ``receiver`` never import each other;
* ``asyncsync/`` has at most 10 entries besides ``__init__.py``, ``__main__.py``, ``py.typed``;
  no module is over 600 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("asyncsync", "receiver")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    """The project modules ``path`` imports (``from pkg import submodule`` names the submodule).
    ``top_level_only``: what runs at import time (not inside functions nor ``TYPE_CHECKING``)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if top_level_only and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return
        if (
            top_level_only
            and isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test)
        ):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in MODULES else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m.split(".")[0] in PACKAGES and m in MODULES}


def test_no_import_loop() -> None:
    graph = {m: _imports(p, top_level_only=True) - {m} for m, p in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                loop = [*stack[stack.index(n) :], n]
                pytest.fail("import loop: " + " -> ".join(loop))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


#: bottom first; a module belongs to the longest prefix that names it
LAYERS: tuple[tuple[str, ...], ...] = (
    ("asyncsync.errors",),
    ("asyncsync.fsio", "asyncsync.memory", "asyncsync.pipeline", "asyncsync.console"),
    ("asyncsync.format",),
    ("asyncsync.codec",),
    ("asyncsync.publish", "receiver"),  # the two sides, which never import each other
    ("asyncsync.training",),  # config, settings, staleness, factory, session
    ("asyncsync.training.ray",),  # Ray actors: receivers beside engines, trainer ranks
    ("asyncsync.training.slime",),  # slime's updater: its receivers may be Ray actors
    ("asyncsync.ops",),
    ("asyncsync", "asyncsync.__main__"),  # the package's public names, the command
)


def layer_of(module: str) -> int:
    found = [
        (len(name), i)
        for i, names in enumerate(LAYERS)
        for name in names
        if module == name or module.startswith(name + ".")
    ]
    assert found, f"{module} is in no layer: add it to LAYERS"
    return max(found)[1]


def upward(graph: dict[str, set[str]]) -> list[str]:
    """The imports of ``graph`` (module -> modules it imports) that go to a higher layer."""
    return [
        f"{m} (layer {layer_of(m)}) imports {dep} (layer {layer_of(dep)})"
        for m, deps in sorted(graph.items())
        for dep in sorted(deps)
        if layer_of(dep) > layer_of(m)
    ]


def test_layers_read_one_way() -> None:
    """No module imports one of a higher layer (at any level), so no folder loop can form."""
    assert upward({m: _imports(p, top_level_only=False) for m, p in MODULES.items()}) == []


def test_the_layer_check_catches_a_folder_loop_and_an_import_upwards() -> None:
    """The two faults the layering fix removed (issue 23) fail the check: the training session
    importing the operator's tools (``ops.progress`` then), and the Ray actors and the slime
    integration importing each other (one of the two edges of a loop is always upwards)."""
    assert upward({"asyncsync.training.session": {"asyncsync.ops.progress"}})
    loop = {
        "asyncsync.training.ray.trainers": {"asyncsync.training.slime.engines"},
        "asyncsync.training.slime.engines": {"asyncsync.training.ray.trainers"},
    }
    assert len(upward(loop)) == 1
    assert upward({"receiver.cli": {"asyncsync.ops.cli.common"}})


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        ("asyncsync.format", ("asyncsync.codec", "asyncsync.publish", "asyncsync.training",
                              "asyncsync.ops", "receiver")),
        ("asyncsync.codec", ("asyncsync.publish", "asyncsync.training", "asyncsync.ops",
                             "receiver")),
        ("asyncsync.publish", ("asyncsync.training", "asyncsync.ops", "receiver")),
        ("receiver", ("asyncsync.publish", "asyncsync.training", "asyncsync.ops")),
    ],
)  # fmt: skip
def test_layers(layer: str, forbidden: tuple[str, ...]) -> None:
    bad = []
    for m, path in MODULES.items():
        if m != layer and not m.startswith(layer + "."):
            continue
        for dep in _imports(path, top_level_only=False):
            if any(dep == f or dep.startswith(f + ".") for f in forbidden):
                bad.append(f"{m} imports {dep}")
    assert bad == []


def test_ground_floor_imports_nothing_of_the_project() -> None:
    ground = ("asyncsync.errors", "asyncsync.fsio", "asyncsync.memory", "asyncsync.pipeline")
    inside = ("asyncsync.console", "asyncsync.fsio.")  # (a package's modules import each other)
    for m in ground + tuple(m for m in MODULES if m.startswith(inside)):
        deps = {d for d in _imports(MODULES[m], top_level_only=False) if d != "asyncsync.errors"}
        deps = {d for d in deps if not d.startswith(inside)}
        if m.startswith("asyncsync.console"):  # console/ stands on the ground floor
            deps -= set(ground)
        assert deps == set(), f"{m} imports {deps}"


def test_folder_and_module_sizes() -> None:
    top = [
        p.name
        for p in (REPO / "asyncsync").iterdir()
        if p.name not in ("__init__.py", "__main__.py", "py.typed", "__pycache__")
        and not p.name.endswith((".so", ".pyd"))
    ]
    assert len(top) <= 10, sorted(top)
    for sub in ("publish", "codec", "format"):
        assert (REPO / "asyncsync" / sub / "__init__.py").is_file()
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}
