"""A data root's own sites as FLARE sites (names, subsets, the view), and the job settings its dataset.json implies."""

import json

import pytest

from pflseg.cli import build_parser
from pflseg.data import DataError, make_synthetic, site_dataset
from pflseg.deploy.data_sites import choose_sites, data_overrides, flare_names, project_with_sites, renamed, site_view


def _root(tmp_path, sites=None, **info):
    """A synthetic root, its sites renamed to ``sites`` and dataset.json entries replaced by ``info``."""
    root = make_synthetic(tmp_path / "root", n_sites=len(sites or [1, 2, 3]), cases=3, size=16, depth=2)
    meta = json.loads((root / "dataset.json").read_text())
    if sites:
        for old, new in zip(meta["sites"], sites):
            (root / old).rename(root / new)
        meta["sites"] = list(sites)
    (root / "dataset.json").write_text(json.dumps({**meta, **info}))
    return root


@pytest.mark.parametrize("sites, expected", [
    (["site-1", "site-2"], {"site-1": "site-1", "site-2": "site-2"}),
    (["Hospital A", "Clinic_B"], {"Hospital_A": "Hospital A", "Clinic_B": "Clinic_B"}),
    (["Hospital A", "Hospital_A"], {"Hospital_A-2": "Hospital A", "Hospital_A": "Hospital_A"}),  # valid name kept
    (["St. Mary's (ICU)", "server", "病院"],
     {"St_Mary_s_ICU": "St. Mary's (ICU)", "server_site": "server", "site": "病院"}),
])
def test_flare_names_keep_valid_names_and_replace_the_rest(sites, expected):
    assert flare_names(sites) == expected
    assert list(flare_names(sites).values()) == sites  # the data's order


def test_choose_sites_all_first_n_or_named(tmp_path):
    root = _root(tmp_path, ["Hospital A", "Clinic_B", "Lab-C"])
    assert choose_sites(root) == ["Hospital A", "Clinic_B", "Lab-C"]
    assert choose_sites(root, n=2) == ["Hospital A", "Clinic_B"]
    assert choose_sites(root, names=["Lab-C", "Hospital_A"]) == ["Lab-C", "Hospital A"]  # data or FLARE names
    with pytest.raises(ValueError, match=r"--sites 4: .* has 3 site\(s\)"):
        choose_sites(root, n=4)
    with pytest.raises(ValueError, match=r"--site-names \['Nowhere'\]: not sites of"):
        choose_sites(root, names=["Nowhere"])


def test_site_view_only_when_a_name_needs_another(tmp_path):
    root = _root(tmp_path, ["Hospital A", "Clinic_B", "Lab-C"])
    same, mapping = site_view(root, ["Clinic_B", "Lab-C"], tmp_path / "view1")
    assert same == root.resolve() and mapping == {"Clinic_B": "Clinic_B", "Lab-C": "Lab-C"}
    assert not (tmp_path / "view1").exists() and renamed(mapping) is None

    view, mapping = site_view(root, ["Hospital A", "Clinic_B"], tmp_path / "view2")
    assert view == (tmp_path / "view2").resolve() and mapping == {"Hospital_A": "Hospital A", "Clinic_B": "Clinic_B"}
    assert json.loads((view / "dataset.json").read_text())["sites"] == ["Hospital_A", "Clinic_B"]
    a, b = site_dataset(view, "Hospital_A", "testing", size=16), site_dataset(root, "Hospital A", "testing", size=16)
    assert len(a) == len(b) and (a[0]["image"] == b[0]["image"]).all()
    assert renamed(mapping) == "FLARE site names allow letters, digits, - and _ only: 'Hospital A' as 'Hospital_A'"
    assert site_view(root, ["Hospital A"], tmp_path / "view2")[0] == view  # made again over the old one


@pytest.mark.parametrize("info, user, size, expected", [
    ({}, {}, None, {"net": {"in_channels": 1, "out_channels": 1}}),
    ({"in_channels": 3, "train_size": 128}, {}, None,
     {"net": {"in_channels": 3, "out_channels": 1}, "data": {"size": 128}}),
    ({"in_channels": 3, "train_size": 128}, {}, 64,
     {"net": {"in_channels": 3, "out_channels": 1}, "data": {"size": 64}}),
    ({"in_channels": 3, "train_size": 128, "classes": ["disc", "cup"]},  # the user's --set wins over everything
     {"net": {"in_channels": 1, "out_channels": 1}, "data": {"size": 32}, "rounds": 2}, 64,
     {"net": {"in_channels": 1, "out_channels": 1}, "data": {"size": 32}, "rounds": 2}),
    ({"classes": ["disc", "cup"]}, {"net": {"channels": [4, 8]}}, None,
     {"net": {"channels": [4, 8], "in_channels": 1, "out_channels": 2}}),
])
def test_data_overrides_fill_what_the_user_did_not_set(tmp_path, info, user, size, expected):
    root = _root(tmp_path, **info)
    assert data_overrides(root, user, size) == expected


def test_data_overrides_need_a_data_root(tmp_path):
    with pytest.raises(DataError):
        data_overrides(tmp_path, {})


def test_project_with_sites_replaces_the_clients_only():
    project = {"name": "p", "participants": [
        {"name": "server1", "type": "server", "org": "o"}, {"name": "site-1", "type": "client", "org": "hospital_1"},
        {"name": "admin@p.org", "type": "admin", "org": "o", "role": "project_admin"}]}
    out = project_with_sites(project, ["Hospital_A", "Clinic_B"])
    assert [(p["name"], p["type"], p["org"]) for p in out["participants"]] == [
        ("server1", "server", "o"), ("Hospital_A", "client", "hospital_1"), ("Clinic_B", "client", "hospital_2"),
        ("admin@p.org", "admin", "o")]
    assert project["participants"][1]["name"] == "site-1"  # not modified in place


@pytest.mark.parametrize("argv", [["run", "fedavg"], ["poc"], ["loso"]])
def test_run_commands_take_site_and_size_flags(argv):
    args = build_parser().parse_args(argv + ["--data", "d", "--sites", "2", "--site-names", "a,b", "--size", "96"])
    assert (args.data, args.sites, args.site_names, args.size) == ("d", 2, "a,b", 96)
    assert build_parser().parse_args(argv).sites is None  # default: every site of --data
