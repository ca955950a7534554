"""The package's layers (../shared/DESIGN.md): nothing imports upward, no method branches in flare/, deploy/, eval/
or the CLI, and config.py (below flare/) knows no method's section."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "custom" / "pflseg"
#: lower index = lower layer; a module may import its own layer and those below it
LAYERS = ["algorithms", "nets", "data|train|config|markdown|progress", "infer", "flare", "deploy", "eval", "cli"]


def layer_of(module: str) -> int:
    top = module.split(".")[1] if module.startswith("pflseg.") else module
    for i, names in enumerate(LAYERS):
        if top in names.split("|"):
            return i
    raise AssertionError(f"module {module} belongs to no layer: add it to LAYERS")


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pflseg."):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("pflseg."))
    return out


def test_nothing_imports_upward():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts)
        if module in ("pflseg.__init__", "pflseg.__main__"):
            continue
        mine = layer_of(module if len(rel.parts) > 2 else "pflseg." + rel.parts[1])
        upward += [f"{module} -> {imp}" for imp in imports(path) if layer_of(imp) > mine]
    assert upward == []


def module_name(path: Path) -> str:
    """``custom/pflseg/flare/sites/base.py`` -> ``pflseg.flare.sites.base`` (a package: its ``__init__``'s name)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """pflseg module -> the pflseg modules it imports, at module level or inside a function or ``if`` alike
    (``from pflseg.flare import client``: the module ``client``; ``from pflseg.data import X``: ``pflseg.data``)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pflseg":
                names.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names if a.name.split(".")[0] == "pflseg")
        graph[module] = {m for m in map(resolve, names) if m and m != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_no_import_circle_among_pflseg_modules_counting_imports_inside_functions():
    """Issue 40: a lower module reads what it needs from its caller (dependency inversion), never by importing the
    module that imports it, not even inside a function (the registry ``flare/methods.py`` imports every controller and
    site: they, ``policy.py`` and ``settings.py`` get the registry's facts passed down)."""
    found = circles(import_graph())
    assert found == [], "\n".join(" <-> ".join(c) for c in found)


def method_readers() -> list[Path]:
    """The modules that must read what describes a method from the registry (flare/methods.py), never branch on it."""
    flare = [p for p in (PACKAGE / "flare").rglob("*.py") if p.name != "methods.py"]
    return (flare + sorted((PACKAGE / "deploy").rglob("*.py")) + sorted((PACKAGE / "eval").rglob("*.py"))
            + [PACKAGE / "cli.py"])


def test_the_method_readers_are_where_the_rules_say():
    readers = {str(p.relative_to(PACKAGE)) for p in method_readers()}
    assert {"flare/controllers/base.py", "flare/sites/base.py", "flare/client.py", "deploy/simulator.py",
            "eval/bench.py", "eval/tables.py", "eval/demo.py", "cli.py"} <= readers
    assert "flare/methods.py" not in readers


def test_no_method_branches_in_flare_eval_and_the_cli():
    pattern = re.compile(r"method\W*\]?\s*(==|in \()")
    hits = [f"{p.relative_to(PACKAGE)}:{i}" for p in method_readers()
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []


def test_no_job_or_method_compared_with_a_registered_name():
    """``job == "iopfl_route"``, ``cfg["method"] in ("fedsm", ...)``: a method's behaviour belongs in its registry
    entry, its controller and its site."""
    from pflseg.flare.methods import METHODS

    def names(node) -> set:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        return {e.value for e in getattr(node, "elts", []) if isinstance(e, ast.Constant)}

    hits = []
    for path in method_readers():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                subject = " ".join(ast.unparse(x) for x in sides if not names(x))
                if re.search(r"method|job", subject) and set().union(*map(names, sides)) & set(METHODS):
                    hits.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    assert hits == []


def test_no_method_name_chosen_by_a_condition():
    """``"fedsm" if x else "fedavg"``: which method runs is the registry's business, never an inline choice."""
    from pflseg.flare.methods import METHODS

    hits = [f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}" for path in method_readers()
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.IfExp)
            and any(isinstance(b, ast.Constant) and b.value in METHODS for b in (node.body, node.orelse))]
    assert hits == []


def test_config_reads_no_methods_section():
    """config.py checks the common keys; a method's section (``cfg["fedsm"]``, ``"iopfl.epochs"`` in RANGES) is
    checked by that method's controller (``check_config``), called down into config by the registry."""
    from pflseg.flare.methods import METHOD_SECTIONS

    hits = []
    for node in ast.walk(ast.parse((PACKAGE / "config.py").read_text())):
        key = node.slice if isinstance(node, ast.Subscript) else None
        if isinstance(key, ast.Constant) and key.value in METHOD_SECTIONS:
            hits.append(f"config.py:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Dict):
            hits += [f"config.py:{node.lineno}: {k.value}" for k in node.keys if isinstance(k, ast.Constant)
                     and isinstance(k.value, str) and k.value.split(".")[0] in METHOD_SECTIONS]
    assert hits == []


#: files outside the registry that still name a method or read a method's section or results (issue 40 item 2),
#: each to go (none left). The test fails when a file not listed names one, and when a listed file no longer does
#: (then strike it off).
NAMING_DEBTS: set[str] = set()


def test_eval_cli_deploy_and_config_name_no_method_and_no_methods_section():
    """Every string constant of eval/, cli.py, deploy/ and config.py: no registered method or job name, no method's
    config section (``"fedsm"``, ``"iopfl.comparators"``), no result key only one method writes (the registry's
    ``Column`` readers and ``Method.table`` read those: ``pflseg.flare.columns``). "local" is also FLARE's kit folder
    and a deployment's name, so it is not searched."""
    from pflseg.config import job_names
    from pflseg.flare.methods import METHOD_SECTIONS, METHODS

    names = (set(METHODS) | set(job_names()) | set(METHOD_SECTIONS)) - {"local"}
    result_keys = {"route", "infer", "super", "test_at_gamma", "gamma_selected"}
    files = [*sorted((PACKAGE / "eval").rglob("*.py")), *sorted((PACKAGE / "deploy").rglob("*.py")),
             PACKAGE / "cli.py", PACKAGE / "config.py"]
    hits: dict[str, list[str]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    node.value in names | result_keys or node.value.split(".")[0] in METHOD_SECTIONS
                    and "." in node.value and " " not in node.value):
                hits.setdefault(str(path.relative_to(PACKAGE)), []).append(f"{node.lineno}: {node.value!r}")
    assert {f: h for f, h in hits.items() if f not in NAMING_DEBTS} == {}
    assert NAMING_DEBTS - set(hits) == set()
