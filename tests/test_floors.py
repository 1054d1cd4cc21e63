"""The house has floors that only look down (docs/CONTRACTS.md, "Floors"): a room imports rooms on
lower floors only, never one on its own floor or above. Two checks: every import statement in
canvasq/ (module level and inside functions), and what importing each room really loads, in a
fresh process."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "canvasq"

# room -> floor. A room may import a room on a lower floor. Rooms on one floor never import each
# other: the testbed is a side room beside the ground floor (only the CLI uses it), so the
# kernels, model, decoders, store and worker never see the task families.
FLOORS = {
    "provenance": 0,  # git commit of a report; stdlib only
    "kernels": 0,
    "model": 1,
    "decoders": 2,
    "core": 3,  # ground floor: settings, job schema, SQL tables, the store (queue + reports)
    "testbed": 3,
    "worker": 4,
    "serve": 5,
    "cli": 6,  # top floor: nothing imports it
}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "canvasq" else None


def _imports(path: Path, package_dir: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, lazy ones included."""
    package = list(path.relative_to(package_dir.parent).parts[:-1])  # the file's package, for `from ..`
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "canvasq":  # `from canvasq import decoders`
                found += [(node.lineno, f"canvasq.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, module))
    return found


def _allowed(importer: str, imported: str) -> bool:
    return importer == imported or FLOORS[imported] < FLOORS[importer]


def test_every_room_has_a_floor():
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    rooms |= {p.stem for p in PACKAGE.glob("*.py")}
    rooms.discard("static")
    assert rooms == set(FLOORS), f"rooms without a floor (or floors without a room): {rooms ^ set(FLOORS)}"


def test_no_import_statement_goes_up():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        for line, module in _imports(path):
            imported = _room(module)
            if imported is not None and not _allowed(importer, imported):
                upward.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line}: {importer} (floor {FLOORS[importer]}) "
                    f"imports {module} (floor {FLOORS[imported]})"
                )
    assert not upward, "imports that do not go down the floors:\n" + "\n".join(upward)


def test_the_scan_sees_lazy_and_relative_imports(tmp_path):
    """The scan must catch what it is there to catch: an import inside a function, a relative one."""
    src = tmp_path / "canvasq" / "model" / "x.py"
    src.parent.mkdir(parents=True)
    src.write_text("def f():\n    from canvasq.worker import runtime\n    from ..cli import common\n")
    found = [m for _, m in _imports(src, tmp_path / "canvasq")]
    assert found == ["canvasq.worker", "canvasq.cli"]
    assert not _allowed("model", _room(found[0])) and not _allowed("model", _room(found[1]))


ROOT_MODULES = {  # what importing a room loads: its package and every module in it
    room: sorted(
        {f"canvasq.{room}"}
        | {
            "canvasq." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
            for p in (PACKAGE / room).rglob("*.py")
            if p.name != "__main__.py"
        }
    )
    if (PACKAGE / room).is_dir()
    else [f"canvasq.{room}"]
    for room in FLOORS
}


@pytest.mark.parametrize("room", sorted(FLOORS, key=FLOORS.get))
def test_importing_a_room_loads_no_room_above_it(room):
    code = (
        "import importlib, json, sys\n"
        f"for m in {ROOT_MODULES[room]!r}:\n"
        "    importlib.import_module(m)\n"
        "print(json.dumps(sorted({n.split('.')[1] for n in sys.modules if n.startswith('canvasq.')})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=PACKAGE.parent,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert room in loaded
    above = sorted(r for r in loaded if not _allowed(room, r))
    assert not above, f"importing canvasq.{room} loads {above}, on its floor or above"


def _module_name(path: Path, package_dir: Path = PACKAGE) -> str:
    return ".".join(path.relative_to(package_dir.parent).with_suffix("").parts).removesuffix(".__init__")


def _edges(node: ast.AST, name: str, package: list[str], paths: dict, edges: dict[str, int]) -> None:
    """Collect `name`'s imports below `node` into `edges` (module -> first line), skipping the bodies
    of `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            for other in child.orelse:
                _edges(other, name, package, paths, edges)
            continue
        targets: list[str] = []
        if isinstance(child, ast.Import):
            targets = [a.name for a in child.names]
        elif isinstance(child, ast.ImportFrom):
            base = child.module or ""
            if child.level:
                base = ".".join(package[: len(package) - child.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in child.names]
        for t in targets:
            if t in paths and t != name:
                edges.setdefault(t, child.lineno)
        _edges(child, name, package, paths, edges)


def _module_graph(package_dir: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line}, inside the package, lazy imports included, imports under
    `if TYPE_CHECKING:` left out (they run for the type checker only). `from pkg import name` is an edge
    to `pkg.name` when that is a module, else to `pkg`."""
    paths = {_module_name(p, package_dir): p for p in package_dir.rglob("*.py")}
    graph: dict[str, dict[str, int]] = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        graph[name] = {}
        _edges(ast.parse(path.read_text(), str(path)), name, package, paths, graph[name])
    return graph


def _circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_no_import_circles_between_modules():
    """No module reaches itself through imports, lazy ones included (a function-level import that
    closes a circle still ties the two modules' order of loading to the call)."""
    graph = _module_graph()
    report = [
        " ; ".join(f"{a}:{graph[a][b]} -> {b}" for a in circle for b in graph[a] if b in circle)
        for circle in _circles(graph)
    ]
    assert not report, "import circles:\n" + "\n".join(report)


def test_the_circle_scan_sees_a_lazy_circle(tmp_path):
    pkg = tmp_path / "canvasq" / "room"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from canvasq.room import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from canvasq.room import a\n"
    )
    graph = _module_graph(tmp_path / "canvasq")
    assert _circles(graph) == [["canvasq.room.a", "canvasq.room.b"]]
