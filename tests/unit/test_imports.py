"""The project's import graph, read with `ast` from the source (no module of it imported): no cycle among its
modules, `roles/` (the engines and the trainer) knows no workload of `tasks/`, and the simulator runs
without the engines, the trainer and the storage (so without vLLM or torch). Every import statement
counts, one inside a function too."""
import ast
from pathlib import Path

from conftest import ROOT


def project_modules() -> dict[str, Path]:
    """Every module of the project by dotted name (`planner`, `roles`, `roles.judge`, `sim.__main__`) with
    its path: the top-level files and those of the top-level folders, tests/ aside."""
    paths = [*ROOT.glob("*.py"), *(p for p in ROOT.glob("*/*.py") if not p.parent.name.startswith((".", "tests")))]
    modules = {}
    for path in paths:
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports(name: str, modules: dict[str, Path]) -> set[str]:
    """The project's modules that module `name` imports. `import a.b` and `from a.b import c` name a.b (or
    a, where a.b is no module of the project), and a.b.c too where that is a module."""
    path = modules[name]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            # every import is absolute, from the root (the scripts run with it on sys.path); a relative
            # one would need resolving here
            assert not node.level, f"{path}:{node.lineno}: a relative import"
            targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports(name, modules) for name in modules}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of imports (its first module again at the end), or None: a depth-first walk that meets a
    module still on its path."""
    done, path = set(), []

    def walk(name):
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        path.append(name)
        for other in sorted(graph[name]):
            cycle = walk(other)
            if cycle:
                return cycle
        path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        cycle = walk(name)
        if cycle:
            return cycle
    return None


def reached(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module that importing `start` imports, with the chain of imports that leads to it."""
    chains, todo = {start: [start]}, [start]
    while todo:
        name = todo.pop()
        for other in sorted(graph[name] - set(chains)):
            chains[other] = chains[name] + [other]
            todo.append(other)
    return chains


def in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_graph_holds_every_part_of_the_project():
    """The checks below see the modules they are about (none of them passes on an empty graph), and the
    walk finds a cycle it is shown."""
    graph = import_graph()
    assert {"pivot_train", "planner", "storage", "roles", "roles.judge", "shifting.scheduler", "sim.engine",
            "tasks.longtail", "bench.placements"} <= set(graph)
    # `from shifting import book` names the package and its module
    assert {"shifting", "shifting.book"} <= graph["sim.engine"] and "roles.engine" in graph["roles.judge"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_among_the_project_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_roles_import_nothing_from_tasks():
    """Nor through another module: the engines and the trainer serve any workload, and what one needs of
    it (prompt ids, drawn lengths, the prompt encoder) its caller hands over."""
    graph = import_graph()
    found = [" -> ".join(chain) for name in sorted(graph) if in_package(name, "roles")
             for other, chain in sorted(reached(graph, name).items()) if in_package(other, "tasks")]
    assert not found, "\n".join(found)


def test_the_simulator_imports_neither_roles_nor_storage():
    """Not even through planner.py or the scheduling book: the simulator drives the same planner with a
    clock and a cost model, no engine, trainer or storage behind it. The `roles` package's own names
    (roles/__init__.py: ROLES, ENGINE_ROLES, named once for the whole project) are no engine."""
    graph = import_graph()
    found = [" -> ".join(chain) for name in sorted(graph) if in_package(name, "sim")
             for other, chain in sorted(reached(graph, name).items())
             if (in_package(other, "roles") and other != "roles") or other == "storage"]
    assert not found, "\n".join(found)
