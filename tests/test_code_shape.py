"""Lint checks on the package's shape, read from the source with `ast` (nothing is imported).

- No import cycle between moetide modules or packages (the layers of ARCHITECTURE.md), counting
  imports inside functions and imports by name (`__import__`, `importlib.import_module`): a lazy
  import hides a cycle from Python, not from the reader.
- No function over 80 lines unless a comment on its `def` line says why it reads better whole
  (`# long: <reason>`).
- The engine never imports the offline analysis tools, and no code outside the policy registry
  compares policy names.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "moetide"
MAX_FUNCTION_LINES = 80
LONG_REASON = re.compile(r"#\s*long:\s*\S")


def module_name(path: Path) -> str:
    parts = ["moetide", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


_BY_NAME = object()  # an import by a name that is not a literal: known only when it runs


def _dynamic_import(node: ast.Call):
    """The module named by `__import__("m", ...)` or `importlib.import_module("m")` /
    `import_module("m")`: the literal name, `_BY_NAME` for a computed one, None for another call."""
    f = node.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
    if name not in ("__import__", "import_module") or not node.args:
        return None
    if isinstance(f, ast.Attribute) and not (isinstance(f.value, ast.Name) and f.value.id == "importlib"):
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else _BY_NAME


def imports_in(source: str, name: str, package: str, modules: dict[str, Path]) -> set[str]:
    """moetide modules that module `name` (in `package`) imports anywhere in `source`: import
    statements, `__import__` and `importlib.import_module` calls (a name from a package that is
    itself a module counts as that module: `from . import quant` -> `moetide.store.quant`). A module
    that imports a computed name imports, as far as this reader knows, every moetide module one of
    its string literals names (the table `cli` loads its sub-commands from, say)."""

    def resolve(level: int, module: str | None) -> str:
        if not level:
            return module or ""
        base = package.split(".")
        base = base[: len(base) - (level - 1)]
        return ".".join(base + ([module] if module else []))

    nodes = list(ast.walk(ast.parse(source, name)))
    named = [
        n.value
        for n in nodes
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in modules
    ]
    computed = any(isinstance(n, ast.Call) and _dynamic_import(n) is _BY_NAME for n in nodes)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            root = resolve(node.level, node.module)
            targets = [
                f"{root}.{alias.name}" if f"{root}.{alias.name}" in modules else root for alias in node.names
            ]
        elif isinstance(node, ast.Call) and isinstance(dynamic := _dynamic_import(node), str):
            dots = len(dynamic) - len(dynamic.lstrip("."))
            targets = [resolve(dots, dynamic[dots:] or None)]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import moetide.x.y` where y is a name
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found | ({m for m in named if m != name} if computed else set())


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """`imports_in` of the module at `path`."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return imports_in(path.read_text(), name, package, modules)


def import_graph() -> dict[str, set[str]]:
    modules = source_files()
    return {name: imported_modules(path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycle_between_moetide_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_between_moetide_packages():
    """The layers of ARCHITECTURE.md point one way: no subpackage imports one that imports it back."""
    graph: dict[str, set[str]] = {}
    for name, targets in import_graph().items():
        top = ".".join(name.split(".")[:2])
        graph.setdefault(top, set()).update(
            t2 for t2 in (".".join(t.split(".")[:2]) for t in targets) if t2 != top
        )
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_imports_by_name_count_as_imports():
    """`__import__` and `importlib.import_module` with a literal name are edges of the graph, so a
    command that loads its sub-commands by name and is imported back by one of them is a cycle."""
    modules = source_files()
    source = """
import importlib
from importlib import import_module

def load():
    __import__("moetide.serve.cli", fromlist=["register_cli"])
    importlib.import_module("moetide.bench.cli")
    import_module(".eval.cli", "moetide")
    other.import_module("moetide.analysis")  # not importlib's
"""
    found = imports_in(source, "moetide.cli", "moetide", modules)
    assert found == {"moetide.serve.cli", "moetide.bench.cli", "moetide.eval.cli"}
    table = """
for module in ("moetide.serve.cli", "moetide.bench.cli", "not a module"):
    __import__(module, fromlist=["register_cli"])
"""
    assert imports_in(table, "moetide.cli", "moetide", modules) == {"moetide.serve.cli", "moetide.bench.cli"}
    assert imports_in('NAME = "moetide.serve.cli"', "moetide.cli", "moetide", modules) == set()
    graph = import_graph()
    graph["moetide.serve.cli"] = graph["moetide.serve.cli"] | {"moetide.cli"}
    assert find_cycle(graph) == ["moetide.cli", "moetide.serve.cli", "moetide.cli"]


def long_functions(path: Path) -> list[str]:
    """`module:function (N lines)` for each function over the limit without its reason comment."""
    text = path.read_text()
    lines = text.splitlines()
    out = []
    for node in ast.walk(ast.parse(text, str(path))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        start = min([d.lineno for d in node.decorator_list] + [node.lineno])
        length = node.end_lineno - start + 1
        header = lines[node.lineno - 1 : node.body[0].lineno]
        if length > MAX_FUNCTION_LINES and not any(LONG_REASON.search(h) for h in header):
            out.append(f"{module_name(path)}:{node.name} ({length} lines)")
    return out


def test_no_function_over_80_lines_without_its_reason():
    long = [f for path in sorted(SRC.rglob("*.py")) for f in long_functions(path)]
    assert not long, "functions over 80 lines: " + ", ".join(long)


def test_engine_never_imports_analysis():
    graph = import_graph()
    runtime = [m for m in graph if not m.startswith(("moetide.analysis", "moetide.bench", "moetide.eval"))]
    runtime = [m for m in runtime if m not in ("moetide.cli",)]
    bad = [(m, t) for m in runtime for t in graph[m] if t.startswith("moetide.analysis")]
    assert not bad, f"{bad[0][0]} imports the offline tools ({bad[0][1]})"


# "lru" is left out: it also names an eviction rule.
_NAMES = r"""["'](combined|finemoe|dynaexq|on-demand|moe-infinity|static-int[24]|no-offload)["']"""
POLICY_NAME_COMPARISON = re.compile(rf"(==|!=|\bin\b)\s*\(?\s*{_NAMES}|{_NAMES}\s*:")


def test_no_policy_name_comparison_outside_the_registry():
    hits = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "registry.py" and path.parent.name == "policies":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if POLICY_NAME_COMPARISON.search(line.split("#")[0]):
                hits.append(f"{path.relative_to(SRC)}:{i}: {line.strip()}")
    assert not hits, "policy names compared outside policies/registry.py:\n" + "\n".join(hits)
