"""The message key format (``pflseg.flare.wire``): one flat dict, a prefix per network, one per site."""

import ast
from pathlib import Path

import torch

from pflseg.flare import wire
from pflseg.flare.wire import PERSON, by_site, only, prefixed, sites_in, split_by_site, unprefixed


def test_by_site_and_split_by_site_are_inverse_and_keep_the_order():
    states = {"site-2": {"w": torch.ones(2), "b": torch.zeros(1)}, "site-1": {"w": torch.zeros(2)}}
    flat = by_site(PERSON, states)
    assert list(flat) == ["person.site-2.w", "person.site-2.b", "person.site-1.w"]
    back = split_by_site(PERSON, flat, ["site-1", "site-2", "site-3"])
    assert list(back) == ["site-1", "site-2", "site-3"] and back["site-3"] == {}  # a site without keys: empty
    assert all(torch.equal(back[s][k], v) for s, state in states.items() for k, v in state.items())
    assert sites_in(PERSON, {**flat, "personx.site-9.w": 1, "global.w": 2}) == ["site-1", "site-2"]


def test_only_keeps_the_named_parts_and_prefixed_round_trips():
    flat = {**prefixed("global", {"w": 1}), **prefixed("select", {"w": 2}), "person.site-1.w": 3, "persons.w": 4}
    assert only(flat, "global", PERSON) == {"global.w": 1, "person.site-1.w": 3}
    assert unprefixed("select", flat) == {"w": 2}


#: wire.py's helpers whose prefix arguments name a part (``only``: every argument after the dict)
PREFIX_ARGS = {"prefixed": slice(0, 1), "unprefixed": slice(0, 1), "by_site": slice(0, 1),
               "split_by_site": slice(0, 1), "sites_in": slice(0, 1), "only": slice(1, None)}
WIRE_PREFIXES = {v for k, v in vars(wire).items() if k.isupper() and isinstance(v, str)}
#: file names that begin like a key (``best.pt``: a site's best model, not the ``best`` prefix)
FILE_SUFFIXES = {".pt", ".json", ".jsonl", ".md", ".yaml", ".txt", ".csv"}


def hand_spelled_prefixes(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of each wire prefix that ``source`` spells as a string of its own: a prefix argument of
    wire.py's helpers (``prefixed("global", ...)``), or a string or an f-string's text that begins with
    ``<prefix>.`` (``"person."``, ``f"heads.{site}"``). Docstrings, file names (``best.pt``) and the same words
    used as other keys (``metrics["global"]``: a test result's model name) are not prefixes."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    dotted = tuple(p + "." for p in WIRE_PREFIXES)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            for arg in node.args[PREFIX_ARGS[name]] if name in PREFIX_ARGS else []:
                found += [(c.lineno, c.value) for c in ast.walk(arg)
                          if isinstance(c, ast.Constant) and c.value in WIRE_PREFIXES]
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(dotted)
              and id(node) not in docstrings and Path(node.value).suffix not in FILE_SUFFIXES):
            found.append((node.lineno, node.value))
    return sorted(set(found))


def test_the_scan_finds_a_prefix_spelled_by_hand_and_nothing_else():
    spelled = '''
send = prefixed("global", state)
heads = {s: unprefixed(f"heads.{s}", flat) for s in sites}
dp = ("person.",)
picked = only(flat, "select", GLOBAL)
model = unprefixed("global" if m == "global" else f"person.{m}", flat)
'''
    assert hand_spelled_prefixes(spelled) == [(2, "global"), (3, "heads."), (4, "person."), (5, "select"),
                                              (6, "global"), (6, "person.")]
    named = '''
"""A docstring may say person.<site>."""
send = prefixed(GLOBAL, state)
own = unprefixed("model", best)
metrics["global"] = {"site": 1}
keep = {"optim.model": 1}
path = root / "best.pt"
'''
    assert hand_spelled_prefixes(named) == []


def test_no_module_spells_a_wire_prefix_by_hand():
    """Issue 40 item 4: sites, controllers, the evaluation and the rest of the package name message prefixes
    through wire.py only."""
    folder = Path(wire.__file__).parent.parent
    found = {str(p.relative_to(folder)): hand_spelled_prefixes(p.read_text()) for p in sorted(folder.rglob("*.py"))
             if p.name != "wire.py"}
    assert {path: hits for path, hits in found.items() if hits} == {}
