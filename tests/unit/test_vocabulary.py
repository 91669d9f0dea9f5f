"""One vocabulary (roles/__init__.py), read with `ast` from the project's source (tests/ aside): the code
names a role by its `roles.Role` member, never by a bare string literal (roles/__init__.py defines the
values), and the judge is nowhere called genrm, the old name, except as the shipped model's folder,
models/arith-genrm. A member reads as its value wherever the code writes one (JSON, messages, printed
dicts), which is what lets the enum stand in for the strings the records and the tests hold. A slot is a
simulated rank and nothing else (storage's pieces are regions), and `step_seconds` holds RL steps' seconds
only: an engine step's are `engine_step_seconds`."""
import ast
import json

from test_imports import project_modules

from roles import ENGINE_ROLES, ROLES, Role

OLD_NAME = "genrm"
FOLDER = "arith-genrm"  # data: the judge model's directory keeps its name
# Where `step_seconds` is bound: the simulator's result and the run that fills it, both RL steps' seconds.
RL_STEP_SECONDS = {("sim.engine", "Result"), ("sim.engine", "run")}


def parsed() -> dict[str, ast.Module]:
    """Every project module's syntax tree, by dotted name."""
    return {name: ast.parse(path.read_text(), str(path)) for name, path in sorted(project_modules().items())}


def docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring constants in a module: the prose that may introduce the term GenRM."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def identifiers(node: ast.AST) -> list[str]:
    """The names a node binds or uses: variables, attributes, functions, classes, arguments, keywords and
    imported modules."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, ast.keyword):
        return [node.arg] if node.arg else []
    if isinstance(node, ast.alias):
        return [node.name, *([node.asname] if node.asname else [])]
    if isinstance(node, ast.ImportFrom):
        return [node.module or ""]
    return []


def bindings(tree: ast.Module) -> list[tuple[str, str, int]]:
    """(innermost enclosing class or function, name, line) for each name a module binds: functions,
    classes, arguments, assigned variables and attributes, and annotated fields."""
    found = []

    def visit(node: ast.AST, scope: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append((scope, node.name, node.lineno))
            scope = node.name
        elif isinstance(node, ast.arg):
            found.append((scope, node.arg, node.lineno))
        elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            found.append((scope, node.id if isinstance(node, ast.Name) else node.attr, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, "")
    return found


def test_no_bare_role_literal_outside_roles():
    values = {role.value for role in Role}
    found = [f"{name}:{node.lineno}: {node.value!r}" for name, tree in parsed().items() if name != "roles"
             for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in values]
    assert not found, f"name these roles by their Role member: {found}"


def test_the_judge_is_not_called_genrm():
    found = []
    for name, tree in parsed().items():
        prose = docstrings(tree)
        for node in ast.walk(tree):
            words = identifiers(node)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
                words.append(node.value.replace(FOLDER, ""))
            found += [f"{name}:{node.lineno}: {word!r}" for word in words if OLD_NAME in word.lower()]
    assert OLD_NAME not in " ".join(project_modules()), "a module still named after genrm"
    assert not found, f"call it the judge: {found}"


def test_a_role_reads_as_its_value():
    assert ROLES == (Role.ROLLOUT, Role.JUDGE, Role.TRAIN) and ENGINE_ROLES == ROLES[:2]
    assert json.dumps({Role.JUDGE: [Role.TRAIN]}) == '{"judge": ["train"]}'
    assert f"{Role.ROLLOUT}_s {Role.JUDGE:>6s}" == "rollout_s  judge" and str(Role.TRAIN) == "train"
    assert repr({Role.ROLLOUT: 2}) == "{'rollout': 2}"
    assert {"judge": 1}[Role.JUDGE] == 1 and Role("train") is Role.TRAIN and Role.JUDGE == "judge"


def test_step_seconds_are_rl_steps():
    found = [f"{name}:{line}: {scope or 'module'}" for name, tree in parsed().items()
             for scope, word, line in bindings(tree)
             if word == "step_seconds" and (name, scope) not in RL_STEP_SECONDS]
    assert not found, f"an engine step's seconds are engine_step_seconds; step_seconds is an RL step's: {found}"
    assert {scope for name, tree in parsed().items() for scope, word, _ in bindings(tree)
            if word == "step_seconds"} == {scope for _, scope in RL_STEP_SECONDS}, "the RL steps' list has moved"
