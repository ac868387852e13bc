"""The shape of the code (DESIGN.md, "The shape of the code"), read from the source with ``ast`` so
a violation is named by file and line:

- packages import one way, down :data:`ORDER`; no module-level import cycle;
- outside a package, code reaches it through its face (``from jaxtp.parallel import named``,
  never ``from jaxtp.parallel.sharding import named``), and only for what the face's ``__all__``
  offers;
- no module imports another module's ``_private`` names;
- no re-export outside a package's ``__init__``: a module uses every jaxtp name it imports;
- no module outgrows the 700-line hard cap.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "jaxtp"
MAX_LINES = 700
# bottom up; packages on one level may not import each other. The top-level modules api and
# testing sit on one level above serve and inspect; __main__ and __init__ are the entry points.
ORDER: tuple[tuple[str, ...], ...] = (
    ("configs",), ("pipeline",), ("parallel",), ("layers",), ("step",), ("planner",),
    ("data", "ckpt", "hf"), ("train",), ("serve", "inspect"), ("api", "testing"), ("cli",),
    ("__main__",))
LEVEL = {p: i for i, level in enumerate(ORDER) for p in level}


def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _rel(path: Path) -> str:
    """``jaxtp/parallel/mesh.py``: a module's path from the package's parent."""
    return str(path.relative_to(MODULES["jaxtp"].parent.parent))


def _package(module: str) -> str:
    """``jaxtp.parallel.mesh`` -> ``parallel``; a top-level module is its own package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(name: str, path: Path):
    """``(line, imported module, imported names, bound local names)`` of every jaxtp import in
    ``path``, at module level, inside functions or under ``if TYPE_CHECKING`` alike."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "jaxtp":
                    yield node.lineno, alias.name, (), alias.asname or alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if base.split(".")[0] != "jaxtp":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in MODULES:  # `from jaxtp.step import plain`: the submodule
                    yield node.lineno, sub, (), alias.asname or alias.name
                else:
                    yield node.lineno, base, (alias.name,), alias.asname or alias.name


def _graph() -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for name, path in MODULES.items():
        for _, target, _, _ in _imports(name, path):
            if target in MODULES and target != name and name != "jaxtp":
                graph[name].add(target)
    return graph


def test_no_import_cycles():
    """``jaxtp/__init__`` (the lazy public names) is the one module allowed to name modules from
    above; every other import edge must leave the graph acyclic."""
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_package_has_a_level():
    packages = {_package(m) for m in MODULES} - {""}
    assert packages <= set(LEVEL), f"packages missing from ORDER: {sorted(packages - set(LEVEL))}"


def test_packages_import_only_downward():
    """An import from a package on the same or a higher level of :data:`ORDER` is an upward (or
    sideways) edge: the lower package would depend on the one built on it."""
    bad = []
    for name, path in MODULES.items():
        here = _package(name)
        if not here:
            continue
        for line, target, _, _ in _imports(name, path):
            there = _package(target)
            if there and there != here and LEVEL[there] >= LEVEL[here]:
                bad.append(f"{_rel(path)}:{line} ({here}) imports "
                           f"{target} ({there})")
    assert not bad, "imports against the package order:\n" + "\n".join(bad)


def _face_names(package: str) -> set[str]:
    tree = ast.parse(MODULES[f"jaxtp.{package}"].read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__"
                                                for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def test_other_packages_are_reached_through_their_face():
    """From outside package P, jaxtp imports only ``jaxtp.P`` and only names its ``__all__``
    lists: every name has one import path, and the face is the package's whole offer."""
    bad = []
    for name, path in MODULES.items():
        here = _package(name)
        for line, target, names, local in _imports(name, path):
            there = _package(target)
            if not there or there == here or target == "jaxtp":
                continue
            if target.count(".") == 1 and target in MODULES and there not in LEVEL:
                continue  # a top-level module (jaxtp.api): it is its own face
            where = f"{_rel(path)}:{line}"
            if target.count(".") > 1 and not (names == () and target.rpartition(".")[2]
                                               in _face_names(there)):
                bad.append(f"{where} imports {target} past the face jaxtp.{there}")
            for n in names:
                if n not in _face_names(there):
                    bad.append(f"{where} imports {n} from jaxtp.{there}, which does not offer it")
    assert not bad, "\n".join(bad)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_imports_another_modules_private_names():
    bad = []
    for name, path in MODULES.items():
        module_aliases = {}
        for line, target, names, local in _imports(name, path):
            bad += [f"{path.name}:{line} imports {target}.{n}" for n in names if _private(n)]
            if not names and target in MODULES:
                module_aliases[local.split(".")[-1] if "." in local else local] = target
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in module_aliases and _private(node.attr)
                    and module_aliases[node.value.id] != name):
                bad.append(f"{path.name}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_no_reexports_outside_the_faces():
    """A module other than a package's ``__init__`` uses every jaxtp name it imports: an unused
    import there would be a second home for the name."""
    bad = []
    for name, path in MODULES.items():
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        used |= {n.value.id for n in ast.walk(tree)
                 if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
        for line, _, _, local in _imports(name, path):
            bound = local.split(".")[0]
            if bound not in used:
                bad.append(f"{_rel(path)}:{line} imports {local} "
                           "and does not use it")
    assert not bad, "\n".join(bad)


def test_no_module_shadows_a_name_it_imports():
    """A module-level ``def`` / ``class`` with the name of something the module imports from
    jaxtp replaces the import silently (and its calls go to the wrong function)."""
    bad = []
    for name, path in MODULES.items():
        imported = {local.split(".")[0]: line for line, _, _, local in _imports(name, path)}
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in imported:
                bad.append(f"{_rel(path)}:{node.lineno} defines {node.name}, imported at line "
                           f"{imported[node.name]}")
    assert not bad, "\n".join(bad)


def test_modules_stay_under_the_line_cap():
    long = {_rel(p): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_checker_can_fail(tmp_path, monkeypatch):
    """Each check fires: a cycle, a private import, an upward edge, an import past a face, a
    name the face does not offer, a re-export, a shadowed import."""
    pkg = tmp_path / "jaxtp"
    for sub in ("configs", "parallel"):
        (pkg / sub).mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "configs" / "__init__.py").write_text("from jaxtp.configs.a import thing\n"
                                                 "__all__ = ['thing']\n")
    (pkg / "configs" / "a.py").write_text("from jaxtp.configs.b import _hidden\n"
                                          "from jaxtp.parallel import ring\nthing = 1\n")
    (pkg / "configs" / "b.py").write_text("from jaxtp.configs.a import thing\n_hidden = thing\n")
    (pkg / "parallel" / "__init__.py").write_text("__all__ = []\n")
    (pkg / "parallel" / "ring.py").write_text("from jaxtp.configs.a import thing\n"
                                              "from jaxtp.configs import other\n"
                                              "def other(): return thing\n")
    monkeypatch.setattr(sys.modules[__name__], "MODULES", _modules(pkg))
    checks = [
        (test_no_import_cycles, "jaxtp.configs.a -> jaxtp.configs.b -> jaxtp.configs.a"),
        (test_no_module_imports_another_modules_private_names, "a.py:1 imports .*_hidden"),
        (test_packages_import_only_downward, r"configs/a.py:2 \(configs\) imports "
                                             r"jaxtp.parallel.ring \(parallel\)"),
        (test_other_packages_are_reached_through_their_face,
         "parallel/ring.py:1 imports jaxtp.configs.a past the face"),
        (test_other_packages_are_reached_through_their_face,
         "parallel/ring.py:2 imports other from jaxtp.configs, which does not offer it"),
        (test_no_reexports_outside_the_faces, "configs/a.py:2 imports ring and does not use it"),
        (test_no_module_shadows_a_name_it_imports, "parallel/ring.py:3 defines other"),
    ]
    for check, message in checks:
        with pytest.raises(AssertionError, match=message):
            check()
