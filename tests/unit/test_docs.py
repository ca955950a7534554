"""Every `pflseg ...` command in README.md and docs/*.md code blocks parses with the real argument parser, names jobs
that exist and config keys that load, so no documented command goes stale; the documents' links point at files that
exist; the README keeps its two set-up commands (the test command byte for byte as .ci/run runs it).

The README's quick starts are run end to end in tests/integration/test_quickstart.py.
"""

import argparse
import functools
import re
import shlex
from pathlib import Path

import pytest

from pflseg.cli import build_parser
from pflseg.config import job_names, load_job_config, parse_set

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|", "&"}


def code_blocks(path: Path) -> list[tuple[int, str]]:
    """The shell code blocks of a Markdown file: (line number of the opening fence, text)."""
    blocks, lang, start, lines = [], None, 0, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = re.match(r"^\s*```\s*(\S*)", line)
        if fence and lang is None:
            lang, start, lines = fence.group(1), number, []
        elif fence:
            if lang in SHELL_BLOCKS:
                blocks.append((start, "\n".join(lines)))
            lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def commands(text: str) -> list[list[str]]:
    """Every command of a shell block, as argv: lines joined at a trailing backslash, comments dropped, split at
    ``&&``, ``;`` and pipes, leading ``VAR=value`` assignments dropped."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        argv: list[str] = []
        for token in [*lexer, ";"]:
            if token in SEPARATORS:
                while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
                    argv.pop(0)
                if argv:
                    out.append(argv)
                argv = []
            else:
                argv.append(token)
    return out


def documented(program: str) -> list[tuple[str, list[str]]]:
    """``(where, argv)`` of every documented command that starts with ``program``."""
    return [(f"{path.relative_to(REPO)}:{line}", argv) for path in DOCS for line, block in code_blocks(path)
            for argv in commands(block) if argv[0] == program]


PFLSEG = documented("pflseg")


@functools.cache
def strict_parser() -> argparse.ArgumentParser:
    """pflseg's parser (``pflseg.cli.build_parser``, whatever its commands and subcommands), refusing abbreviated
    options: a documented ``--round`` would parse as ``--rounds`` today and break when another ``--round...`` comes."""
    def walk(parser):
        parser.allow_abbrev = False
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)
        return parser

    return walk(build_parser())


def test_the_documents_hold_commands_at_all():
    """The extraction itself: a change of the fences or the splitting must not leave the tests below empty."""
    assert len(PFLSEG) >= 60
    where = {w.split(":")[0] for w, _ in PFLSEG}
    assert {"README.md", "docs/running.md", "docs/methods.md", "docs/benchmark.md", "docs/data.md",
            "docs/deployment.md", "docs/speed.md", "docs/configuration.md"} <= where
    assert commands("a && B=1 pflseg run x --set 'k=[a,b]'  # note\npflseg y \\\n --z 1; c | d") == [
        ["a"], ["pflseg", "run", "x", "--set", "k=[a,b]"], ["pflseg", "y", "--z", "1"], ["c"], ["d"]]


@pytest.mark.parametrize("where,argv", PFLSEG, ids=[w for w, _ in PFLSEG])
def test_every_documented_pflseg_command_parses(where, argv, capsys):
    try:
        args = strict_parser().parse_args(argv[1:])
    except SystemExit as exit_:  # --help / --version exit 0; a parse error exits 2 with argparse's message
        assert exit_.code == 0, f"{where}: {shlex.join(argv)}\n{capsys.readouterr().err}"
        return
    jobs = [args.job] if getattr(args, "job", None) and args.cmd in ("run", "poc") else getattr(args, "names", None)
    for job in jobs or []:
        assert job in job_names(), f"{where}: {shlex.join(argv)}: no app_configs/{job}.yaml"
        load_job_config(job, overrides=parse_set(getattr(args, "set", None) or []))  # keys and values valid


@pytest.mark.parametrize("where,argv", documented("nvflare"), ids=[w for w, _ in documented("nvflare")])
def test_documented_nvflare_commands_name_committed_jobs(where, argv):
    """`nvflare simulator jobs/<name>`: the committed job exists (a job under runs/ is made by the line before)."""
    folders = [a for a in argv if a.startswith("jobs/")]
    assert all((REPO / a / "meta.json").is_file() for a in folders), f"{where}: {shlex.join(argv)}"


def test_the_nvflare_simulator_example_has_its_allow_list_step_beside_it():
    """Before: README's `nvflare simulator jobs/fedavg` failed with ComponentNotAuthorized, the allow-list step
    500 lines further down."""
    for path in DOCS:
        for _, block in code_blocks(path):
            argvs = commands(block)
            for i, argv in enumerate(argvs):
                if argv[:2] == ["nvflare", "simulator"]:
                    workspace = argv[argv.index("-w") + 1]
                    before = " ".join(" ".join(a) for a in argvs[:i])
                    assert f"a('{workspace}/local/resources.json')" in before, f"{path.name}: {shlex.join(argv)}"


def test_the_readme_keeps_its_two_set_up_commands():
    readme = REPO / "README.md"
    ci = (REPO / ".ci" / "run").read_text().splitlines()[-1]
    lines = [block for _, block in code_blocks(readme)]
    assert ci == lines[1] and "pip install -e \".[test]\"" in lines[1]
    assert 'pytest -m "not gpu and not extended"' in lines[1]
    assert lines[0].startswith("python3.11 -m venv .venv") and lines[0].endswith("pflseg demo")
    assert len(readme.read_text().splitlines()) <= 200


def test_links_between_the_documents_point_at_files_and_headings_that_exist():
    def anchors(path: Path) -> set[str]:
        heads = [line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]
        return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}

    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
                broken.append(f"{path.relative_to(REPO)}: {target}")
    assert broken == []


def test_no_document_sends_users_to_the_projects_shared_folder():
    assert [p.name for p in DOCS if "../shared" in p.read_text()] == []
