"""The package shape holds: imports point one way between subpackages, no module imports another's
private names, and there is no import circle; ARCHITECTURE.md draws the layers in this order and
places every module, naming none that does not exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lower layers first; a module may import from its own layer and the ones before it.
LAYERS = {
    "diskkit": ["errors", "limits", "progress", "streams", "oci", "registry", "transports", "signing", "layers", "disk", "source", "ops", "cli"],
    "launcher": ["hostfs", "spec", "render", "chunks", "node", "diskserver", "volumes", "datavolumes", "network", "runtime", "cli"],
}
# Pure layers: they compute, the shell around them does the I/O.
PURE = {"launcher.render": {"os", "subprocess", "socket", "shutil", "libvirt", "requests", "fcntl"}}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in LAYERS:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import in the file, nested ones too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((a.name, None, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:
                if f"{base}.{a.name}" in MODULES:
                    found.append((f"{base}.{a.name}", None, node.lineno))
                else:
                    found.append((base, a.name, node.lineno))
    return found


def _layer(module: str) -> tuple[str, int] | None:
    top, _, rest = module.partition(".")
    if top not in LAYERS or not rest:
        return None
    part = rest.split(".")[0]
    return top, LAYERS[top].index(part) if part in LAYERS[top] else -1


GRAPH = {m: {i for i, _, _ in _imports(m, p) if i in MODULES and i != m} for m, p in MODULES.items()}


def test_every_module_sits_in_a_known_layer():
    loose = [m for m in MODULES if _layer(m) is not None and _layer(m)[1] < 0 and m.count(".") > 1]
    assert loose == [], "subpackages missing from LAYERS"


def test_diskkit_never_imports_launcher():
    wrong = [f"{m} imports {i}" for m, deps in GRAPH.items() if m.startswith("diskkit") for i in deps if i.startswith("launcher")]
    assert wrong == []


def test_imports_point_down_the_layers():
    wrong = []
    for m, deps in GRAPH.items():
        here = _layer(m)
        for dep in deps:
            there = _layer(dep)
            if here and there and here[0] == there[0] and here[1] >= 0 and there[1] > here[1]:
                wrong.append(f"{m} imports {dep}")
    assert wrong == []


def test_no_cross_module_private_imports():
    wrong = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {mod}.{name}"
             for m, p in MODULES.items() for mod, name, line in _imports(m, p)
             if name and name.startswith("_") and not name.startswith("__") and mod in MODULES and mod != m]
    assert wrong == []


def test_no_import_circles():
    # Tarjan's strongly connected components; a package's own __init__ is not a dependency of its modules.
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if v.startswith(w + "."):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert circles == []


@pytest.mark.parametrize("package", sorted(PURE))
def test_pure_layers_do_no_io(package):
    wrong = [f"{m} imports {i}" for m, p in MODULES.items() if m.startswith(package + ".")
             for i, _, _ in _imports(m, p) if i.split(".")[0] in PURE[package]]
    assert wrong == []


def test_every_subpackage_says_what_it_owns():
    quiet = [str(p.relative_to(ROOT)) for p in ROOT.glob("*/*/__init__.py")
             if p.parts[-3] in LAYERS and len((ast.get_docstring(ast.parse(p.read_text())) or "").split()) < 12]
    assert quiet == []


def test_the_checks_catch_what_they_look_for(tmp_path):
    # The checks above must be able to fail: a circle, an upward and a private import, written fresh.
    pkg = tmp_path / "launcher"
    (pkg / "spec").mkdir(parents=True)
    (pkg / "render").mkdir()
    (pkg / "spec" / "a.py").write_text("from launcher.render.b import _x\n")
    (pkg / "render" / "b.py").write_text("from launcher.spec import a\n_x = 1\n")
    a = _imports("launcher.spec.a", pkg / "spec" / "a.py")
    assert a == [("launcher.render.b", "_x", 1)]
    assert _layer("launcher.spec.a")[1] < _layer("launcher.render.b")[1]


ARCHITECTURE = ROOT / "ARCHITECTURE.md"
# `diskkit.x.y`, `launcher.x.Name`: a module, or a name defined in one.
DOTTED = re.compile(r"`((?:diskkit|launcher)(?:\.\w+)*)`")
# `tests/x.py`, `examples/kubernetes/`: a path of the repository (placeholders like <cache> are not).
PATH = re.compile(r"`((?:diskkit|launcher|tests|bench|scripts|docs|examples|images)/[^`<>*\s]*)`")


def _defined(node: ast.AST) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def _resolves(dotted: str, modules: dict[str, Path]) -> bool:
    """The longest prefix that is a module, then each further part defined in the one before it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in modules:
            body = ast.parse(modules[module].read_text()).body
            for name in parts[cut:]:
                found = next((n for n in body if name in _defined(n)), None)
                if found is None:
                    return False
                body = getattr(found, "body", [])
            return True
    return False


# `runtime.vms`: a module named without its package, which the check above could not follow. Left
# alone: `spec.` (KubeVirt's field paths start so: spec.domain.devices) and file names (`disk.img`).
SHORT = re.compile(r"`((?:%s)\.\w[\w.]*)(?<!\.img)(?<!\.json)(?<!\.sock)(?<!\.log)`"
                   % "|".join(sorted({layer for layers in LAYERS.values() for layer in layers} - {"spec"})))


def test_the_map_names_only_what_exists():
    text = ARCHITECTURE.read_text()
    missing = sorted({d for d in DOTTED.findall(text) if not _resolves(d, MODULES)})
    missing += sorted({p for p in PATH.findall(text) if not (ROOT / p).exists()})
    assert missing == []
    assert sorted(set(SHORT.findall(text))) == [], "name modules in full (launcher.runtime.vms), so they can be checked"


def test_the_map_places_every_module():
    named = set(DOTTED.findall(ARCHITECTURE.read_text()))
    assert sorted(set(MODULES) - named) == [], "modules ARCHITECTURE.md does not place (give each a row with its job)"


def test_the_map_draws_the_layers_in_their_order():
    # The diagram's left column is launcher's layers, top down; the column under "diskkit" is diskkit's.
    lines = ARCHITECTURE.read_text().split("```")[1].splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("launcher"))
    right = lines[header].index("diskkit")
    drawn = {"launcher": [], "diskkit": []}
    for line in lines[header + 2:]:
        if word := re.match(r"[a-z]+", line):
            drawn["launcher"].append(word.group())
        if len(line) > right and line[right - 1] == " " and (word := re.match(r"[a-z]+", line[right:])):
            drawn["diskkit"].append(word.group())
    assert drawn == {pkg: layers[::-1] for pkg, layers in LAYERS.items()}


def test_the_map_checks_catch_what_they_look_for():
    assert _resolves("launcher.runtime.vms.run", MODULES) and _resolves("launcher.runtime.runner.Libvirt.start", MODULES)
    assert not _resolves("launcher.runtime.portforward", MODULES)
    assert not _resolves("launcher.runtime.vms.no_such_name", MODULES)
    assert SHORT.findall("`runtime.portforward` `disk.img` `spec.domain.clock`") == ["runtime.portforward"]
