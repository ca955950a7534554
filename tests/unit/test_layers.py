"""The package's layers (../shared/DESIGN.md): nothing imports upward, and no method branches in flare/, eval/ or
the CLI."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "custom" / "pflseg"
#: lower index = lower layer; a module may import its own layer and those below it
LAYERS = ["algorithms", "nets", "data|train|config", "infer", "flare", "deploy", "eval", "cli"]


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


def method_readers() -> list[Path]:
    """The modules that must read what describes a method from the registry (flare/methods.py), never branch on it."""
    flare = [p for p in (PACKAGE / "flare").rglob("*.py") if p.name != "methods.py"]
    return flare + sorted((PACKAGE / "eval").rglob("*.py")) + [PACKAGE / "cli.py"]


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
