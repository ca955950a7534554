"""What leaves a site: with the default config, nothing a site sends names a file of its data set or holds an
absolute path, and test metrics leave only at the end. Every task of every method's site class is answered
through the client script's ``answer`` (as FLARE calls it) on the tiny data set; everything in each reply
(params keys, metrics, meta; keys and values, walked recursively) is searched."""

import re

import pytest
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.flare.client import answer
from pflseg.flare.privacy import Pseudonyms, public_text
from pflseg.flare.state import prefixed
from pflseg.nets.selector import build_selector, selector_cfg
from tests.unit.flare.sites.conftest import SITES

LC = {"net": {"name": "lcfed", "channels": [4, 8, 8], "strides": [2, 2]}}
FINAL = 2  # the tiny config's rounds: the final validate / test tasks carry this round


def strings(value):
    """Every string in ``value`` (dict keys and values, lists, FLModel fields), recursively; tensors skipped."""
    if isinstance(value, FLModel):
        for part in (value.params, value.metrics, value.meta):
            yield from strings(part or {})
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from strings(item)
    elif isinstance(value, str):
        yield value


def data_file_names(root) -> set[str]:
    """Names and stems of every file of the data set (case ids come from them)."""
    names = set()
    for path in root.rglob("*"):
        if path.is_file():
            names.update({path.name, path.name.split(".")[0]})
    return names


ABSOLUTE = re.compile(r"(^|[\s'\"(=:,\[])(/|~/|[A-Za-z]:\\)[^\s]")


def leaks(replies, root, tmp_path) -> list[str]:
    names = data_file_names(root)
    found = []
    for reply in replies:
        assert not (reply.meta or {}).get("pflseg_error"), reply.meta["pflseg_error"]
        for text in strings(reply):
            hits = [n for n in names if n in text]
            if hits or ABSOLUTE.search(text) or str(tmp_path) in text or str(root) in text:
                found.append(f"{text!r} (data files {hits})" if hits else repr(text))
    return found


def selector_state(fed, classes):
    return prefixed("select", build_selector(selector_cfg(fed.cfg, classes)).state_dict())


def models(fed, prefixes):
    out = {}
    for prefix in prefixes:
        out.update(prefixed(prefix, fed.initial))
    return out


class Runner:
    """Answers tasks the way the client script does, one site object per site name."""

    def __init__(self, fed):
        self.fed, self.sites, self.replies = fed, {}, []

    def __call__(self, task, msg, site="site-1"):
        out, self.sites[site] = answer(site, task, msg, self.sites.get(site))
        self.replies.append(out)
        return out


def fedavg_like(method, **over):
    def scenario(federation):
        fed = federation(method, **over)
        run = Runner(fed)
        run("train", fed.message(0))
        run("validate", fed.message(FINAL))
        run("test", fed.message(FINAL))
        return fed, run.replies
    return scenario


def local(federation):
    fed = federation("local")
    run = Runner(fed)
    run("train", fed.message(0))
    run("train", fed.message(1, {}))
    run("validate", fed.message(FINAL, {}))
    run("test", fed.message(FINAL, {}))
    return fed, run.replies


def iopfl(federation):
    fed = federation("iopfl")
    run = Runner(fed)
    run("train", fed.message(0))
    run("validate", fed.message(FINAL))
    run("test", fed.message(FINAL))
    run("submit_model", fed.message(FINAL, {}))
    return fed, run.replies


def fedsm(federation):
    fed = federation("fedsm")
    run = Runner(fed)
    run("train", fed.message(0, {**models(fed, ["global", "person"]), **selector_state(fed, 2)}, selector_label=0))
    run("validate", fed.message(FINAL, models(fed, ["global", "person"])))
    run("test", fed.message(FINAL))
    return fed, run.replies


def lcfed(federation):
    fed = federation("lcfed", **LC)
    run = Runner(fed)
    run("train", fed.message(0))
    run("validate", fed.message(FINAL))
    run("test", fed.message(FINAL, {}))
    return fed, run.replies


def ft(federation):
    fed = federation("ft", ft={"epochs": 1})
    run = Runner(fed)
    run("train", fed.message(0))
    run("finetune", fed.message(FINAL))
    run("test", fed.message(FINAL))
    return fed, run.replies


def fedsm_infer(federation):
    fed = federation("fedsm_infer")
    run = Runner(fed)
    params = {**models(fed, ["global"] + [f"person.{s}" for s in SITES]), **selector_state(fed, len(SITES))}
    for site in ("site-1", "site-3"):  # an inside site and an outside one
        run("infer", fed.message(0, params, inside_sites=SITES, sites=SITES + ["site-3"]), site)
    return fed, run.replies


def iopfl_route(federation):
    fed = federation("iopfl_route", iopfl={"epochs": 1})
    run = Runner(fed)
    params = models(fed, ["global"] + [f"person.{s}" for s in SITES])
    run("route", fed.message(0, params, inside_sites=SITES, sites=SITES + ["site-3"], prior=[0.1]), "site-3")
    return fed, run.replies


SCENARIOS = {"fedavg": fedavg_like("fedavg"), "fedbn": fedavg_like("fedbn"), "grace": fedavg_like("grace"),
             "local": local,
             "iopfl": iopfl, "fedsm": fedsm, "lcfed": lcfed, "ft": ft, "fedsm_infer": fedsm_infer,
             "iopfl_route": iopfl_route}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_nothing_a_site_sends_names_a_data_file_or_an_absolute_path(scenario, federation, tiny_root, tmp_path):
    fed, replies = SCENARIOS[scenario](federation)
    assert not fed.cfg["privacy"]["per_case"] and not fed.cfg["privacy"]["round_test"]  # the defaults
    assert not leaks(replies, tiny_root, tmp_path), leaks(replies, tiny_root, tmp_path)
    assert not any("per_case" in s for r in replies for s in strings(r))
    assert any(isinstance(v, float) for r in replies for v in (r.metrics or {}).values())  # metrics do leave
    if scenario in ("iopfl_route", "fedsm_infer"):  # predictions: written at the site, named relative to its state
        key = scenario.split("_")[1]
        assert all(r.metrics[key]["predictions"] == f"written at the site: {scenario}/predictions" for r in replies)
        assert list((tmp_path / "state" / "site-3" / scenario / "predictions").iterdir())


def test_iopfl_sends_test_dice_only_at_the_end_unless_asked(federation):
    fed = federation("iopfl")
    out, site = answer("site-1", "train", fed.message(0), None)
    assert "val_dice_person" in out.metrics and not any(k.startswith("test") for k in out.metrics)
    fed = federation("iopfl", privacy={"round_test": True})
    out, _ = answer("site-2", "train", fed.message(0), None)
    assert 0 <= out.metrics["test_dice_global"] <= 1 and 0 <= out.metrics["test_dice_person"] <= 1


def test_per_case_is_an_opt_in_with_pseudonyms_under_a_site_salt(federation, tiny_root, tmp_path):
    fed = federation("fedavg", privacy={"per_case": True})
    run = Runner(fed)
    run("train", fed.message(0))
    run("train", fed.message(0), "site-2")
    test = run("test", fed.message(FINAL)).metrics["test"]
    per_case = test["site"]["per_case"]
    assert len(per_case) == test["site"]["n_cases"] >= 1
    assert all(re.fullmatch(r"case-[0-9a-f]{16}", k) for k in per_case)
    assert not leaks(run.replies, tiny_root, tmp_path)
    salt = tmp_path / "state" / "site-1" / "privacy_salt"
    assert salt.is_file() and oct(salt.stat().st_mode & 0o777) == "0o600"
    again = Runner(fed)("test", fed.message(FINAL)).metrics["test"]["site"]["per_case"]
    assert again == per_case  # the same pseudonyms from the same salt
    other = Runner(fed)("test", fed.message(FINAL), "site-2").metrics["test"]["site"]["per_case"]
    assert not set(other) & set(per_case)  # another site, another salt: the same case ids, other names


def test_an_error_reply_holds_no_absolute_path(federation, tmp_path):
    fed = federation("local", resume=True)
    out, _ = answer("site-1", "train", fed.message(3, {}), None)  # resumed, no state before round 3
    error = out.meta["pflseg_error"]
    assert "no state before round 3 in <state>/local" in error and str(tmp_path) not in error


@pytest.mark.parametrize("text, expected", [
    ("state file /srv/pflseg/state/site-1/fedbn/round_0001.pt is corrupt", "state file .../round_0001.pt is corrupt"),
    ("(policy.per_case: false, from /srv/Smith/local/pflseg_site.json)", "(policy.per_case: false, from "
                                                                          ".../pflseg_site.json)"),
    ("image '/data/hospital/Case07.nii.gz' unreadable", "image '<file>' unreadable"),
    ("data root C:\\data\\site (from env)", "data root <file> (from env)"),
    ("~/data/x.png missing", "<file> missing"),
    ("relative imagesTr/case1.nii.gz and 3/4 and a / b stay", "relative <file> and 3/4 and a / b stay"),
    ("No such file or directory: '/data/John Smith MRN4711.png'", "No such file or directory: '<file>'"),
    ("bare Smith_John_MRN4711_1960-01-01.png.", "bare <file>."),
    ("train.lr=0.1 must be > 0; 10 img/s, ~3x, 'global.conv.weight'", "train.lr=0.1 must be > 0; 10 img/s, ~3x, "
                                                                       "'global.conv.weight'"),
])
def test_public_text_hides_paths_and_data_file_names(text, expected):
    assert public_text(text) == expected


def test_public_text_names_hidden_files_by_pseudonyms_the_site_log_can_resolve(tmp_path):
    named = {}
    text = public_text("cannot identify image file '/data/Smith_John_MRN4711_1960-01-01.png' (and x.nii.gz)",
                       tmp_path / "site-1", Pseudonyms(tmp_path / "site-1"), named)
    assert re.fullmatch(r"cannot identify image file 'file-[0-9a-f]{16}' \(and file-[0-9a-f]{16}\)", text), text
    assert sorted(named.values()) == ["/data/Smith_John_MRN4711_1960-01-01.png", "x.nii.gz"]
    again = public_text("'/data/Smith_John_MRN4711_1960-01-01.png'", None, Pseudonyms(tmp_path / "site-1"))
    assert again.strip("'") in named  # the same file, the same pseudonym


def test_public_text_names_state_paths_relative_to_the_state_root(tmp_path):
    text = f"could not write round_0001.pt into state folder {tmp_path / 'site-1' / 'fedbn'}: No space left"
    assert (public_text(text, tmp_path / "site-1") == "could not write round_0001.pt into state folder <state>/fedbn: "
            "No space left")


# ---- errors: codes, counts and pseudonyms leave the site; the detail stays in its local log ----------------
PATIENT = "Smith_John_MRN4711_1960-01-01"


def _corrupt_file(site_dir, dl):
    entry = dl["training"][0]
    bad = (site_dir / entry["image"]).with_name(f"{PATIENT}.nii.gz")
    bad.write_bytes(b"not a nifti")
    entry["image"] = str(bad.relative_to(site_dir))
    return PATIENT, "unreadable_file x1 [file-"


def _case_in_two_splits(site_dir, dl):
    dl["testing"].append(dict(dl["training"][0]))
    return dl["training"][0]["case"], "case_in_two_splits x1 [case-"


@pytest.mark.parametrize("attack", [_corrupt_file, _case_in_two_splits])
def test_a_data_error_sends_codes_and_pseudonyms_and_keeps_the_detail_local(attack, tiny_root, tmp_path, monkeypatch,
                                                                              caplog):
    """Issue 23 item 3: before, the reply and the ERROR line in FLARE's log (streamed to the server) named the
    file (the patient's name) or the case id."""
    import json
    import logging
    import shutil

    from tests.unit.flare.sites.conftest import Federation

    root = shutil.copytree(tiny_root, tmp_path / "data")
    dl_path = root / "site-1" / "datalist.json"
    dl = json.loads(dl_path.read_text())
    secret, expected = attack(root / "site-1", dl)
    dl_path.write_text(json.dumps(dl))
    fed = Federation("fedavg", root, tmp_path / "state", monkeypatch)
    with caplog.at_level(logging.DEBUG):  # every record FLARE's log handlers (and its log streaming) would see
        out, site = answer("site-1", "train", fed.message(0), None)
    error = out.meta["pflseg_error"]
    assert site is None and expected in error and "(detail in the site's <state>/site_errors.log)" in error
    assert re.search(r"\[(file|case)-[0-9a-f]{16}\]", error)
    assert secret not in error and str(root) not in error and str(tmp_path) not in error
    assert caplog.records and not [r.getMessage() for r in caplog.records if secret in r.getMessage()]
    local = tmp_path / "state" / "site-1" / "site_errors.log"
    detail = local.read_text()
    assert secret in detail and str(root) in detail  # the operator's detail: the file with its path
    pseudonym = re.search(r"\[((file|case)-[0-9a-f]{16})\]", error).group(1)
    assert f"{pseudonym} = [site-1]" in detail  # which file or case the pseudonym stands for
    assert oct(local.stat().st_mode & 0o777) == "0o600"


def test_an_outside_sites_empty_split_is_logged_without_its_paths(tiny_root, tmp_path, monkeypatch, caplog):
    """A post-training job reads every image of an outside site; a split it cannot use is left out with a log line
    that FLARE's log may carry: codes there, the paths in the site-local log only."""
    import json
    import logging
    import shutil

    from tests.unit.flare.sites.conftest import Federation

    root = shutil.copytree(tiny_root, tmp_path / "data")
    dl_path = root / "site-1" / "datalist.json"
    dl = json.loads(dl_path.read_text())
    dl["testing"] = []
    dl_path.write_text(json.dumps(dl))
    site = Federation("fedavg", root, tmp_path / "state", monkeypatch).site("site-1")
    with caplog.at_level(logging.DEBUG):
        images = site.all_images()
    assert len(images) > 0  # training and validation are still used
    lines = [r.getMessage() for r in caplog.records if "without split testing" in r.getMessage()]
    ours = [r for r in caplog.records if r.name.startswith("pflseg")]  # (MONAI's reader logs its own paths)
    assert lines and not [r for r in ours if str(root) in r.getMessage()], lines
    assert str(root) in (tmp_path / "state" / "site-1" / "site_errors.log").read_text()
