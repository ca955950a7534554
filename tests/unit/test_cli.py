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


def _handlers(parser):
    """Every handler a command runs: the ``func`` default of each leaf parser."""
    return {" ".join(path): p._defaults["func"] for path, p in _parsers(parser) if "func" in p._defaults}


def test_every_command_has_its_own_handler_and_every_handler_is_a_few_lines():
    import inspect

    handlers = _handlers(build_parser())
    assert {"run", "bench", "loso", "report speed", "report iopfl-cost", "data synth", "deploy stop",
            "site check"} <= set(handlers)
    long = {name: len(inspect.getsource(f).splitlines()) for name, f in handlers.items()
            if len(inspect.getsource(f).splitlines()) > 10}
    assert long == {}


def test_a_shared_flag_is_declared_once_and_means_the_same_everywhere():
    from pflseg.cli import SHARED

    flags = {name: [a for _, p in _parsers(build_parser()) for a in p._actions
                    if f"--{name.replace('_', '-')}" in a.option_strings] for name in ("rounds", "threads", "set")}
    assert all(a.type.__name__ == "_positive" for a in flags["rounds"] + flags["threads"])
    assert all(a.default == [] and a.metavar == "KEY=VALUE" for a in flags["set"]) and len(flags["set"]) >= 5
    assert {"workspace", "data", "sites", "site_names", "seeds", "set", "threads"} <= set(SHARED)


@pytest.mark.parametrize("argv, preset", [(["data", "synth", "--out", "x"], None), (["bench"], "bench"),
                                          (["report", "heterogeneity", "--preset", "none"], None),
                                          (["loso", "--preset", "demo"], "demo")])
def test_preset_none_is_the_plain_generator(argv, preset):
    assert build_parser().parse_args(argv).preset == preset


def test_every_report_is_a_module_with_a_report_function_and_a_choice_of_the_command():
    import importlib

    from pflseg.cli import REPORTS

    report = next(p for path, p in _parsers(build_parser()) if path == ("report",))
    (choice,) = [a for a in report._actions if a.dest == "report"]
    assert list(choice.choices) == list(REPORTS) and all(name in choice.help for name in REPORTS)
    for module in REPORTS.values():
        assert callable(importlib.import_module(module).report)


def test_each_report_shows_only_its_own_flags(capsys):
    """Before: `pflseg report --help` listed every report's flags in one list (--sizes beside --preset)."""
    flags = {}
    for name in ("iopfl-cost", "heterogeneity", "grace-benchmark"):
        with pytest.raises(SystemExit):
            main(["report", name, "--help"])
        flags[name] = capsys.readouterr().out
    assert "--sizes" in flags["iopfl-cost"] and "--preset" not in flags["iopfl-cost"]
    assert "--preset" in flags["heterogeneity"] and "--sizes" not in flags["heterogeneity"]
    assert "--repeats" in flags["grace-benchmark"] and "--workspace" not in flags["grace-benchmark"]
    with pytest.raises(SystemExit):
        main(["report", "iopfl-cost", "--preset", "bench"])  # another report's flag is refused
    assert "unrecognized arguments: --preset" in capsys.readouterr().err


def test_report_runs_the_named_module_with_every_flag(monkeypatch, capsys):
    import types

    import pflseg.cli as cli

    seen = {}
    fake = types.SimpleNamespace(report=lambda **flags: seen.update(flags) or "| table |")
    monkeypatch.setitem(sys.modules, "pflseg_fake_report", fake)
    monkeypatch.setitem(cli.REPORTS, "grace-benchmark", "pflseg_fake_report")
    assert main(["report", "grace-benchmark", "--sites", "3"]) == 0
    assert capsys.readouterr().out.strip() == "| table |" and seen["sites"] == 3 and seen["repeats"] == 5


def test_run_passes_its_flags_to_the_run_once(monkeypatch):
    import pflseg.eval.runs as runs

    calls = []
    monkeypatch.setattr(runs, "run_job", lambda *a, **kw: calls.append((a, kw)))
    assert main(["run", "fedbn", "--sites", "2", "--site-names", "a, b", "--rounds", "3", "--set", "train.lr=0.1",
                 "--resume", "--threads", "1"]) == 0
    ((args, kw),) = calls
    assert args == ("fedbn", None) and kw == {"sites": 2, "site_names": ["a", "b"], "rounds": 3, "threads": 1,
                                              "data": None, "size": None, "resume": True, "sets": ["train.lr=0.1"]}


def test_loso_is_the_bench_of_the_methods_the_outside_claims_need_with_every_site_held_out(monkeypatch):
    import pflseg.eval.bench as bench

    calls = []
    monkeypatch.setattr(bench, "run_bench", lambda **kw: calls.append(kw))
    assert main(["loso", "--seeds", "3"]) == 0
    assert main(["bench", "--methods", "fedavg", "--holdout", "site-1", "--no-outside"]) == 0
    loso, plain = calls
    # IOP-FL routing, FedSM's super model and GRACE's global model make outside claims; GRACE's is against FedAvg
    assert loso["methods"] == ["fedavg", "fedsm", "grace", "iopfl"]
    assert loso["holdout"] == ["all"] and loso["outside"] and loso["seeds"] == [3]
    assert plain["methods"] == ["fedavg"] and plain["holdout"] == ["site-1"] and not plain["outside"]


def test_job_overrides_are_the_sets_then_the_size():
    from pflseg.deploy.data_sites import job_overrides

    assert job_overrides(["rounds=3", "data.size=48"], None, 64) == {"rounds": 3, "data": {"size": 48}}
    assert job_overrides([], None, 64) == {"data": {"size": 64}} and job_overrides([], None, None) == {}


def test_the_sites_of_a_run_without_data_are_the_names_else_the_count_else_the_default():
    from pflseg.deploy.data_sites import planned_sites, run_sites

    assert run_sites(None, "ws", 4, None) == (None, None, 4) and run_sites(None, "ws", None, None, default=2)[2] == 2
    assert run_sites(None, "ws", 4, ["a", "b"]) == (None, ["a", "b"], 2)
    assert planned_sites(None, 2) == ["site-1", "site-2"] and planned_sites(None, 5, ["a"]) == ["a"]


def test_a_sites_policy_holds_only_what_its_flags_change():
    from pflseg.deploy.site_setup import site_policy

    assert site_policy() == {}
    assert site_policy(["fedavg"], no_publish=True, allow_two_sites=True) == {"methods": ["fedavg"], "publish": False,
                                                                                "two_sites": True}
