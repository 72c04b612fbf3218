"""Measure rlflow's import graph: module-level import circles and ``rlflow`` imports inside functions.

Every ``import`` / ``from ... import`` in ``src/rlflow`` counts, at the top of a module or inside a function (an
import inside a function still ties the two modules together; it only hides the circle from Python). Imports under
``if TYPE_CHECKING:`` or ``if __name__ == "__main__":`` do not count: they never run on import. ``from pkg import name`` points at ``pkg.name`` when that is a
module, else at ``pkg`` (its ``__init__``); importing ``a.b.c`` is not counted as importing ``a`` and ``a.b`` too,
or every package ``__init__`` would join every circle.

    python scripts/import_graph.py            # circles, package two-way edges, in-function imports
    python scripts/import_graph.py --list     # ... and every in-function rlflow import, file:line
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def modules(src: Path = SRC) -> dict[str, Path]:
    """Every module under ``src/rlflow``: dotted name -> file."""
    found = {}
    for path in sorted((src / "rlflow").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _never_imported(node: ast.If) -> bool:
    """``if TYPE_CHECKING:`` and ``if __name__ == "__main__":`` blocks: they never run when the module is imported."""
    test = node.test
    if isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__":
        return any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """``(imported module, line, inside a function)`` for each rlflow import in one module."""
    is_package = path.name == "__init__.py"
    found: list[tuple[str, int, bool]] = []

    def target(base: str, names: list[str]) -> list[str]:
        out = []
        for alias in names:
            sub = f"{base}.{alias}"
            out.append(sub if sub in known else base)
        return out

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _never_imported(child):
                for other in child.orelse:
                    visit_one(other, in_function)
                continue
            visit_one(child, in_function)

    def visit_one(child: ast.AST, in_function: bool) -> None:
        if isinstance(child, ast.Import):
            for alias in child.names:
                if alias.name.split(".")[0] == "rlflow":
                    found.append((_nearest(alias.name, known), child.lineno, in_function))
        elif isinstance(child, ast.ImportFrom):
            if child.level:  # relative: resolve against this module's package
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (child.level - 1)]
                base = ".".join(package + ([child.module] if child.module else []))
            else:
                base = child.module or ""
            if base.split(".")[0] == "rlflow":
                for mod in target(_nearest(base, known), [a.name for a in child.names]):
                    found.append((mod, child.lineno, in_function))
        else:
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), str(path)), False)
    return [(mod, line, inside) for mod, line, inside in found if mod != name]


def third_party(path: Path) -> set[str]:
    """The other packages a module imports when it is imported (top level, not in functions), by top-level name."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _never_imported(child):
                for other in child.orelse:
                    visit(other)
            elif isinstance(child, ast.Import):
                found.update(a.name.split(".")[0] for a in child.names)
            elif isinstance(child, ast.ImportFrom) and not child.level and child.module:
                found.add(child.module.split(".")[0])
            elif not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                visit(child)
            elif isinstance(child, ast.ClassDef):  # a class body runs on import; its methods do not
                visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found - {"rlflow", "__future__"}


def _nearest(dotted: str, known: dict[str, Path]) -> str:
    while dotted not in known and "." in dotted:
        dotted = dotted.rsplit(".", 1)[0]
    return dotted


def graph(src: Path = SRC) -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """Edges ``module -> imported modules``, and the in-function imports as ``(module, imported, line)``."""
    known = modules(src)
    edges: dict[str, set[str]] = {name: set() for name in known}
    inside = set()
    for name, path in known.items():
        for mod, line, in_function in imports(name, path, known):
            edges[name].add(mod)
            if in_function:
                inside.add((name, mod, line))
    return edges, sorted(inside)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
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
                        out.append(sorted(component))
    return sorted(out, key=lambda c: (-len(c), c))


def package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def two_way_packages(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    pkg_edges = {(package_of(a), package_of(b)) for a, targets in edges.items() for b in targets}
    return sorted((a, b) for a, b in pkg_edges if a < b and (b, a) in pkg_edges and a != "rlflow" != b)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every in-function rlflow import")
    args = parser.parse_args(argv)
    edges, inside = graph()
    found = circles(edges)
    print(f"modules: {len(edges)}   import edges: {sum(map(len, edges.values()))}")
    print(f"import circles (modules that import each other, directly or around a loop): {len(found)}")
    for component in found:
        print(f"  {len(component)}: " + ", ".join(m.removeprefix("rlflow.") for m in component))
    pairs = two_way_packages(edges)
    print(f"packages importing each other: {len(pairs)}")
    for a, b in pairs:
        print(f"  {a.removeprefix('rlflow.')} <-> {b.removeprefix('rlflow.')}")
    files = {m for m, _, _ in inside}
    statements = {(m, line) for m, _, line in inside}
    print(f"rlflow imports inside functions: {len(statements)} statements in {len(files)} files")
    if args.list:
        by_file = defaultdict(list)
        for module, target, line in inside:
            by_file[module].append((line, target))
        for module in sorted(by_file):
            for line, target in sorted(by_file[module]):
                print(f"  {module}:{line} -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
