"""The package's layers (../shared/DESIGN.md): nothing imports upward, and no method branches in flare/."""

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


def test_no_method_branches_in_the_flare_layer():
    pattern = re.compile(r"method\W*\]?\s*(==|in \()")
    hits = [f"{p.relative_to(PACKAGE)}:{i}" for p in (PACKAGE / "flare").rglob("*.py") if p.name != "methods.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []
