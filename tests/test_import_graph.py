"""The import graph of src/: no two files import each other, directly or around a circle, and the library never
imports the command line (only its entry points under the package's name, `python -m shardwise` and `shardwise.cli`,
do, and nothing imports them). Beside it, DESIGN.md rule 8: no file of src/ over 400 lines.

What counts as an edge from file A to file B: any `import` or `from ... import` statement anywhere in A (at module
level, inside a function or method, under `if TYPE_CHECKING:`, in a try block) whose target resolves to B. A
function-level import between two files that import each other is still a circle: it only moves the failure from
import time to call time, and the two files still cannot be read, tested or moved one without the other. A type-only
import is a circle in the reader's sense too. Relative imports are resolved against the importing file's package;
`from package import name` points at package/name.py when that file exists (a submodule), else at the package's
__init__.py; imports of modules outside src/ (torch, the standard library) are not edges. Importing a.b.c also runs
a/__init__.py and a/b/__init__.py; those implicit parent imports are not counted (every file would otherwise be in a
circle with the package __init__ that re-exports it).

The check is Tarjan's strongly connected components over those edges (Tarjan, SIAM J. Comput. 1972): a component of
more than one file is a circle, reported with each member's edges inside it.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

#: `python -m shardwise` (__main__.py) is the one package file that may import shardwise_cli, and no file of the
#: library may import it: an entry point on top of the graph, so the library depends on the command line nowhere.
CLI_ENTRY_POINTS = {"shardwise.__main__"}

#: Known debts in files being reworked elsewhere, each with what breaks it up. An entry must still be true (the
#: tests below fail on a stale one), so the list can only shrink.
PENDING_CIRCLES: set[tuple[str, ...]] = set()
PENDING_LONG: set[str] = set()
MAX_LINES = 400


def modules(src: Path = SRC) -> dict[str, Path]:
    """Every module under src/ by dotted name (a package by its own name, for its __init__.py)."""
    found = {}
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that the file `name` (at `path`) imports anywhere in its body (module docstring)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from pkg import sub` imports pkg/sub.py when it is a module; `from mod import name` imports mod
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)  # others: outside src/ (torch, the stdlib)
    return found


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    known = modules(src)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
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
                        found.append(sorted(component))
    return found


def _describe(graph: dict[str, set[str]], component: list[str]) -> str:
    inside = set(component)
    return "\n".join(f"  {m} -> {', '.join(sorted(graph[m] & inside))}" for m in component)


def test_no_import_circle_between_files():
    graph = import_graph()
    found = [c for c in circles(graph) if tuple(c) not in PENDING_CIRCLES]
    assert not found, "import circles between files of src/:\n" + "\n\n".join(_describe(graph, c) for c in found)
    stale = PENDING_CIRCLES - {tuple(c) for c in circles(graph)}
    assert not stale, f"circles listed as pending that are gone: remove them from PENDING_CIRCLES: {stale}"


def test_the_library_never_imports_the_command_line():
    graph = import_graph()
    offenders = {name: sorted(t for t in targets if t.split(".")[0] == "shardwise_cli")
                 for name, targets in graph.items()
                 if name.split(".")[0] == "shardwise" and name not in CLI_ENTRY_POINTS}
    offenders = {name: targets for name, targets in offenders.items() if targets}
    assert not offenders, f"library modules importing the command line (shardwise_cli): {offenders}"
    through = {name: sorted(graph[name] & CLI_ENTRY_POINTS) for name in graph
               if name.split(".")[0] == "shardwise" and graph[name] & CLI_ENTRY_POINTS}
    assert not through, f"library modules importing the command line's entry points: {through}"


def test_the_checker_finds_a_circle_through_a_function_level_import(tmp_path):
    """The check can fail: a circle closed by an import inside a function, and one through `from . import x`, are
    found; a one-way chain is not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from .c import g\n    return g\n")
    (pkg / "c.py").write_text("from . import a\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    graph = import_graph(tmp_path)
    assert graph["pkg.c"] == {"pkg.a"}
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_no_source_file_over_400_lines():
    """DESIGN.md rule 8: small files, one concept each."""
    long = {p.relative_to(SRC).as_posix(): n for p in SRC.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    over = {name: n for name, n in long.items() if name not in PENDING_LONG}
    assert not over, f"files over {MAX_LINES} lines (split them by concept): {over}"
    stale = PENDING_LONG - set(long)
    assert not stale, f"files listed as pending that are {MAX_LINES} lines or fewer now: remove them: {stale}"
