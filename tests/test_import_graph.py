"""The layering of the library, written down: no import cycles (in `asyncrl/`, `asyncrl_bench/` and `scripts/`),
and which rooms may import which.

    config                      imports only algos and types (the floor under the components)
    data, envs, rewards,        never import the launch path (asyncrl.launch), the transport (asyncrl.rpc) or the
    policies                    run loop (asyncrl.runtime)
    runtime                     never imports asyncrl.rpc (the run logic runs in one process or many)
    asyncrl/                    never imports asyncrl_bench, not even by a string

A cycle means some module can only be imported after another has half-finished importing, which is what
function-level imports were being used to dodge. The graph is read from the source with `ast`, so no
module is imported:

- an edge runs from a module to each `asyncrl` module it imports, at the top level or inside a function
  (an import under `if TYPE_CHECKING:` never runs and does not count);
- `from pkg import name` points at `pkg.name` when that is a module, else at `pkg` itself;
- an edge points at the module named, not at the packages above it (importing `asyncrl.rpc.roles` does run
  `asyncrl/rpc/__init__.py`, but a package's `__init__` that imports its own submodules is not a cycle
  anyone has to work around);
- `importlib.import_module("...")` with a computed name is invisible here (`asyncrl.rpc`'s lazy `__getattr__`).

    python tests/test_import_graph.py    # prints the cycles and the function-level imports
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

PACKAGE = "asyncrl"
REPO = pathlib.Path(__file__).resolve().parents[1]
ROOT = REPO / PACKAGE


def module_files(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """Dotted module name -> source file, for every .py under the package."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_imports(tree: ast.Module):
    """Yields (import node, at_top_level) for every import that can run: the ones under `if TYPE_CHECKING:`
    are skipped; at_top_level is False for one inside a function, class, `if`, `try` or `with`."""
    def visit(node: ast.AST, depth: int):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:  # the `else:` of a TYPE_CHECKING block does run
                    yield from visit_stmt(stmt, depth + 1)
                continue
            yield from visit_stmt(child, depth)

    def visit_stmt(node: ast.AST, depth: int):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, depth == 0
        else:
            yield from visit(node, depth + (1 if isinstance(node, ast.stmt) else 0))

    yield from visit(tree, 0)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules of `module`'s own package that one import statement in it points at."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = module.split(".")
            anchor = anchor if is_package else anchor[:-1]
            anchor = anchor[:len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    targets = set()
    for name in names:
        while name and name not in modules:  # `import asyncrl.x.y as z` -> the deepest module that exists
            name = name.rpartition(".")[0]
        if name.split(".")[0] == module.split(".")[0]:
            targets.add(name)
    return targets


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of the same package (the folder `root`) it imports (top-level and function-level,
    TYPE_CHECKING excluded)."""
    files = module_files(root)
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        graph[module] = set()
        for node, _ in runtime_imports(tree):
            graph[module] |= _targets(node, module, is_package, set(files)) - {module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), each
    sorted, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return sorted(components, key=lambda c: (-len(c), c))


def nested_imports(root: pathlib.Path = ROOT) -> list[tuple[str, int, str]]:
    """(file, line, statement) of every import below the top level of its module (inside a function, class,
    `if`, `try`...), TYPE_CHECKING blocks excluded."""
    found = []
    for module, path in module_files(root).items():
        source = path.read_text()
        for node, top in runtime_imports(ast.parse(source, str(path))):
            if not top:
                found.append((str(path.relative_to(root.parent)), node.lineno, ast.get_source_segment(source, node)))
    return sorted(found)


@pytest.mark.parametrize("folder", [PACKAGE, "asyncrl_bench", "scripts"])
def test_no_import_cycles(folder):
    cycles = import_cycles(import_graph(REPO / folder))
    assert not cycles, (
        f"{folder} has import cycles (modules that import each other, directly or through others; function-level "
        "imports count): " + "; ".join(" <-> ".join(c) for c in cycles)
        + ". Move what both sides need into a lower module that both import.")


def _reaching(graph: dict[str, set[str]], rooms: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    """Edges from a module of `rooms` (dotted prefixes) to one of `forbidden`."""
    def within(name: str, prefixes: tuple[str, ...]) -> bool:
        return any(name == p or name.startswith(p + ".") for p in prefixes)
    return sorted(f"{m} -> {t}" for m, targets in graph.items() if within(m, rooms)
                  for t in targets if within(t, forbidden))


def test_the_run_logic_knows_no_processes():
    # asyncrl.runtime (queue, roster, agent loop, controller) runs in one process or many: it never reaches
    # into the transport that moves it between them
    graph = import_graph()
    assert not _reaching(graph, ("asyncrl.runtime",), ("asyncrl.rpc",))
    assert any(m.startswith("asyncrl.runtime.") for m in graph)


def test_config_is_the_floor_under_the_components():
    graph = import_graph()
    allowed = ("asyncrl.config", "asyncrl.algos", "asyncrl.types")
    config = [m for m in graph if m == "asyncrl.config" or m.startswith("asyncrl.config.")]
    assert len(config) > 3
    reaching = sorted(f"{m} -> {t}" for m in config for t in graph[m]
                      if not any(t == a or t.startswith(a + ".") for a in allowed))
    assert not reaching, f"asyncrl.config imports components: {reaching}; config may import only {allowed}"


def test_components_never_import_the_launch_path():
    graph = import_graph()
    rooms = ("asyncrl.data", "asyncrl.envs", "asyncrl.rewards", "asyncrl.policies")
    assert not _reaching(graph, rooms, ("asyncrl.launch", "asyncrl.rpc", "asyncrl.runtime", "asyncrl.learner"))
    assert not _reaching(graph, ("asyncrl.learner", "asyncrl.runtime", "asyncrl.rpc", "asyncrl.checkpoint",
                                 "asyncrl.tools", "asyncrl.tracking", "asyncrl.planning"), ("asyncrl.launch",))


def test_the_library_never_names_the_benchmarks():
    """Not by an import, and not by a string (an entry point, `importlib`): the benchmarks add their command
    through the `asyncrl.commands` entry-point group."""
    naming = sorted(f"{path.relative_to(REPO)}:{n}" for path in ROOT.rglob("*.py")
                    for n, line in enumerate(path.read_text().splitlines(), 1) if "asyncrl_bench" in line)
    assert not naming, naming


def test_the_top_floor_holds_only_commands_and_records():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert top == ["__init__.py", "cli.py", "evaluate.py", "export.py", "types.py"], top


def test_loggers_are_named_after_their_module():
    """`logging.getLogger(__name__)` everywhere, so configuring `asyncrl.runtime` configures the run loop."""
    named = sorted(f"{path.relative_to(REPO)}:{n}" for path in ROOT.rglob("*.py")
                   for n, line in enumerate(path.read_text().splitlines(), 1)
                   if "getLogger(" in line and "getLogger(__name__)" not in line)
    assert not named, named


def test_cycle_finder_finds_a_planted_cycle(tmp_path):
    """The finder itself: a -> b -> c -> a inside functions is one cycle; d -> a is not part of it; an import
    under TYPE_CHECKING is not an edge."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from asyncrl.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from . import c\n")
    (pkg / "sub" / "c.py").write_text("import asyncrl.a\n")
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nimport asyncrl.a\nif TYPE_CHECKING:\n    from asyncrl import e\n")
    (pkg / "e.py").write_text("from asyncrl import d\n")
    graph = import_graph(pkg)
    assert graph["asyncrl.a"] == {"asyncrl.sub.b"}
    assert graph["asyncrl.d"] == {"asyncrl.a"}
    assert import_cycles(graph) == [["asyncrl.a", "asyncrl.sub.b", "asyncrl.sub.c"]]
    assert nested_imports(pkg) == [("asyncrl/a.py", 2, "from asyncrl.sub import b")]


if __name__ == "__main__":
    cycles = [c for folder in (PACKAGE, "asyncrl_bench", "scripts") for c in import_cycles(import_graph(REPO / folder))]
    print(f"import cycles (strongly connected components of more than one module): {len(cycles)}")
    for c in cycles:
        print(f"  {len(c)}: {' '.join(c)}")
    nested = nested_imports()
    print(f"imports below the top level (function, class, if, try), TYPE_CHECKING excluded: {len(nested)}")
    for path, line, statement in nested:
        print(f"  {path}:{line}: {statement}")
    sys.exit(1 if cycles else 0)
