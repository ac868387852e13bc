"""The shape of the code (DESIGN.md, "The shape of the code"): imports point one way, no module
reaches into another's ``_private`` names, and no module outgrows the 400-line soft cap. Read from
the source with ``ast``, so a violation is named by file and line."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "jaxtp"
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path):
    """``(line, imported module, imported names, bound local names)`` of every jaxtp import in
    ``path``, at module level, inside functions or under ``if TYPE_CHECKING`` alike."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # `if TYPE_CHECKING:` imports count too: they are edges
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
                if sub in MODULES:  # `from jaxtp import step`: the submodule
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
    """The package's ``__init__`` (the public API's re-exports) is the one module allowed to
    import from above; every other import edge must leave the graph acyclic."""
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


def test_modules_stay_under_the_line_cap():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_checker_sees_cycles_and_private_imports(tmp_path, monkeypatch):
    """The checks can fail: a two-module cycle and a private import are found."""
    pkg = tmp_path / "jaxtp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from jaxtp import b\nfrom jaxtp.b import _hidden\n")
    (pkg / "b.py").write_text("from jaxtp.a import thing\n_hidden = 1\n")
    monkeypatch.setattr(__import__(__name__), "MODULES", {
        "jaxtp": pkg / "__init__.py", "jaxtp.a": pkg / "a.py", "jaxtp.b": pkg / "b.py"})
    import pytest
    with pytest.raises(AssertionError, match="jaxtp.a -> jaxtp.b -> jaxtp.a"):
        test_no_import_cycles()
    with pytest.raises(AssertionError, match="a.py:2 imports jaxtp.b._hidden"):
        test_no_module_imports_another_modules_private_names()
