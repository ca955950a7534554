"""The command line as a user meets it: numbers that mean something, help for every option, a fast --help,
a version, and errors that say what to do instead of a traceback."""

import argparse
import subprocess
import sys

import pytest

from pflseg import __version__
from pflseg.cli import build_parser, main


@pytest.mark.parametrize("argv", [
    ["run", "fedavg", "--rounds", "0"],
    ["run", "fedavg", "--sites", "0"],
    ["run", "fedavg", "--threads", "-1"],
    ["poc", "--rounds", "0"],
    ["bench", "--rounds", "0"],
    ["data", "synth", "--out", "x", "--sites", "0"],
    ["submit", "jobs/fedavg", "--kit", "k", "--timeout", "0"],
])
def test_zero_and_negative_counts_are_refused_not_read_as_the_default(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2 and "must be" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--version"])
    assert capsys.readouterr().out.strip() == f"pflseg {__version__}"


def _parsers(parser, path=()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


def test_every_option_has_help():
    missing = [f"pflseg {' '.join(path)} {action.dest}" for path, parser in _parsers(build_parser())
               for action in parser._actions if not action.help and not isinstance(action, argparse._SubParsersAction)]
    assert missing == []


def test_help_imports_no_heavy_module():
    code = ("import sys\nfrom pflseg.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = sorted(m for m in ('torch', 'monai', 'nvflare', 'pflseg.flare.methods') if m in sys.modules)\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out, out


def test_the_bench_reads_its_methods_from_the_registry_only_when_it_is_the_command():
    args = build_parser().parse_args(["bench"])
    assert "fedavg" in args.methods
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--methods", "fedsgd"])


def test_status_of_a_federation_that_is_not_running_says_so(tmp_path, capsys):
    assert main(["deploy", "status", "--workspace", str(tmp_path / "fed")]) == 1
    out = capsys.readouterr()
    assert "no federation running" in out.out and "pflseg deploy local" in out.out and "Traceback" not in out.err


def test_submit_to_a_server_that_is_down_is_an_error_naming_the_kit(tmp_path, monkeypatch, capsys):
    from nvflare.fuel.flare_api.api_spec import NoConnection

    import pflseg.deploy.submit as submit_module

    def down(*args, **kwargs):
        raise NoConnection("cannot connect to server")

    monkeypatch.setattr(submit_module, "submit", down)
    assert main(["submit", "jobs/fedavg", "--kit", str(tmp_path / "admin")]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the FLARE server" in err and str(tmp_path / "admin") in err and "deploy local" in err


def test_sites_is_a_number_everywhere_and_jobs_export_takes_site_names(capsys):
    """Before: `jobs export --sites a,b` took a list of names where every other command takes a count."""
    args = build_parser().parse_args(["jobs", "export", "fedavg", "--gpu-mem", "4", "--site-names", "a,b"])
    assert args.site_names == "a,b"
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["jobs", "export", "fedavg", "--sites", "a,b"])
    assert exit_.value.code == 2 and "--site-names" in capsys.readouterr().err
    counts = [a for path, parser in _parsers(build_parser()) for a in parser._actions
              if "--sites" in a.option_strings and a.help != argparse.SUPPRESS]
    assert counts and all(a.type.__name__ == "_positive" for a in counts)
