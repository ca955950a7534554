"""A data root's own sites as the sites of a run on this machine, and the job settings its dataset.json implies.

``pflseg run``, ``pflseg poc``, ``pflseg deploy local`` and ``pflseg loso`` with ``--data ROOT`` run
on the sites that ROOT's dataset.json lists (``--sites N``: the first N, ``--site-names a,b``: those),
under their own names. FLARE accepts client names of letters, digits, ``-`` and ``_`` only, so a site
folder such as ``Hospital A`` runs as the FLARE site ``Hospital_A``: the run then reads its data through a
view (``site_view``: a dataset.json naming the FLARE names and one link per site to the original folder),
so every site, Centralized's pooling included, finds its data under its FLARE name.

``data_overrides`` fills in ``net.in_channels``, ``net.out_channels`` (from ``in_channels`` and
``classes``) and ``data.size`` (``--size``, else ``train_size`` when the root records it) wherever the
user's own ``--set`` did not; ``job_overrides`` is the whole of a command's ``--set``, ``--data`` and ``--size``.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from pflseg.config import parse_set
from pflseg.data import load_dataset_info
from pflseg.data.files import private_dir

_CLIENT = re.compile(r"^[A-Za-z0-9_-]+$")  # FLARE's client name pattern (nvflare.apis.utils.format_check)
_RESERVED = {"server"}  # the simulator's server folder


def flare_names(sites: list[str]) -> dict[str, str]:
    """``{FLARE client name: data site}`` in the order of ``sites``: a valid name is kept, any other
    character becomes ``_``, and a clash gets ``-2``, ``-3``, ...

    Example: ``["Hospital A", "Clinic_B"]`` -> ``{"Hospital_A": "Hospital A", "Clinic_B": "Clinic_B"}``.
    """
    valid = {s for s in sites if _CLIENT.match(s) and s not in _RESERVED}
    used, names = set(valid), {}
    for site in sites:
        if site in valid:
            names[site] = site
            continue
        base = re.sub(r"[^A-Za-z0-9_-]+", "_", site).strip("_") or "site"
        base = f"{base}_site" if base in _RESERVED else base
        name, k = base, 1
        while name in used:
            k += 1
            name = f"{base}-{k}"
        used.add(name)
        names[site] = name
    return {names[s]: s for s in sites}


def choose_sites(root: str | Path, n: int | None = None, names: list[str] | None = None) -> list[str]:
    """The data sites a run uses: ``names`` (data or FLARE names) if given, else the first ``n`` sites of
    dataset.json, else all of them."""
    sites = load_dataset_info(root)["sites"]
    if names:
        by_flare = flare_names(sites)
        unknown = [s for s in names if s not in sites and s not in by_flare]
        if unknown:
            raise ValueError(f"--site-names {unknown}: not sites of {root} (sites: {sites})")
        return [s if s in sites else by_flare[s] for s in names]
    if n is not None:
        if not 1 <= n <= len(sites):
            raise ValueError(f"--sites {n}: {root} has {len(sites)} site(s) {sites}; use 1..{len(sites)}")
        return sites[:n]
    return list(sites)


def site_view(root: str | Path, sites: list[str], out: str | Path) -> tuple[Path, dict[str, str]]:
    """Where the run reads ``sites`` of ``root`` and under which FLARE names.

    Returns:
        ``(data root, {FLARE name: data site})``: ``root`` itself when every name is a valid FLARE name,
        else ``out`` made a view of ``root`` whose site folders are links named by the FLARE names.
    """
    root = Path(root).resolve()
    mapping = flare_names(sites)
    if all(k == v for k, v in mapping.items()):
        return root, mapping
    out = Path(out)
    private_dir(out)
    for name, site in mapping.items():
        link = out / name
        if link.is_symlink() or link.is_file():
            link.unlink()
        link.symlink_to(root / site, target_is_directory=True)
    info = json.loads((root / "dataset.json").read_text())
    (out / "dataset.json").write_text(json.dumps({**info, "sites": list(mapping)}, indent=1))
    return out.resolve(), mapping


def renamed(mapping: dict[str, str]) -> str | None:
    """A line naming the sites that run under another name, or None."""
    moved = [f"'{site}' as '{name}'" for name, site in mapping.items() if name != site]
    if not moved:
        return None
    return f"FLARE site names allow letters, digits, - and _ only: {', '.join(moved)}"


def data_overrides(root: str | Path, overrides: dict, size: int | None = None) -> dict:
    """``overrides`` (the user's --set) plus what ``root``'s dataset.json implies where they say nothing:
    ``net.in_channels``, ``net.out_channels`` = number of classes, ``data.size`` = ``size`` or the
    recorded ``train_size``."""
    info = load_dataset_info(root)
    out = copy.deepcopy(overrides)
    net, data = out.setdefault("net", {}), out.setdefault("data", {})
    net.setdefault("in_channels", int(info["in_channels"]))
    net.setdefault("out_channels", len(info["classes"]))
    if size is not None or info.get("train_size"):
        data.setdefault("size", int(size if size is not None else info["train_size"]))
    if not data:
        del out["data"]
    return out


def project_with_sites(project: dict, sites: list[str]) -> dict:
    """A parsed project.yml whose client participants are ``sites`` (FLARE names), org ``hospital_<i>``."""
    project = copy.deepcopy(project)
    others = [p for p in project["participants"] if p["type"] != "client"]
    clients = [{"name": s, "type": "client", "org": f"hospital_{i + 1}"} for i, s in enumerate(sites)]
    server = [p for p in others if p["type"] == "server"]
    project["participants"] = server + clients + [p for p in others if p["type"] != "server"]
    return project


def job_overrides(sets: list[str], data: str | Path | None = None, size: int | None = None) -> dict:
    """A job's config overrides from a command line: ``sets`` (``--set KEY=VALUE`` items, ``pflseg.config.parse_set``)
    plus, where they say nothing, what ``data``'s dataset.json implies (``data_overrides``), else ``size`` as
    ``data.size``.

    Example: ``job_overrides(["rounds=3"], None, 64)`` -> ``{"rounds": 3, "data": {"size": 64}}``.
    """
    overrides = parse_set(sets)
    if data:
        return data_overrides(Path(data).resolve(), overrides, size)
    if size:
        overrides.setdefault("data", {}).setdefault("size", size)
    return overrides


def data_sites(data: str | Path, workspace: str | Path, n: int | None = None, names: list[str] | None = None,
               say=print) -> tuple[Path, dict[str, str]]:
    """A run's sites of the data root ``data`` (``choose_sites``: ``names``, else the first ``n``, else all), read
    through a view in ``<workspace>/data_view`` when some need another name (``site_view``); ``say`` names them and
    any renamed one.

    Returns:
        ``(data root to run on, {FLARE name: data site})``.
    """
    root = Path(data).resolve()
    view, mapping = site_view(root, choose_sites(root, n, names), Path(workspace).resolve() / "data_view")
    say(f"sites of {root}: {', '.join(mapping)}")
    if renamed(mapping):
        say(renamed(mapping))
    return view, mapping


def run_sites(data: str | Path | None, workspace: str | Path, n: int | None = None, names: list[str] | None = None,
              default: int = 3, say=print) -> tuple[Path | None, list[str] | None, int]:
    """The sites of a run on this machine: with ``data`` its chosen sites under their FLARE names (``data_sites``),
    else the sites ``names``, else ``n`` (default ``default``) synthetic sites made at each site.

    Returns:
        ``(data root or None, client names or None: the runner's site-1, site-2, ..., number of sites)``.
    """
    if data:
        view, mapping = data_sites(data, workspace, n, names, say)
        return view, list(mapping), len(mapping)
    return None, names, len(names) if names else n or default


def planned_sites(data: str | Path | None, n: int | None = None, names: list[str] | None = None,
                  default: int = 3) -> list[str] | dict[str, str]:
    """The sites ``run_sites`` will use, without making a view or saying anything: ``{FLARE name: data site}`` with
    ``data``, else the site names (``site-1``, ... for ``n`` synthetic sites)."""
    if data:
        return flare_names(choose_sites(Path(data).resolve(), n, names))
    return names or [f"site-{i + 1}" for i in range(n or default)]


def check_run_data(data: str | Path, n: int | None = None, names: list[str] | None = None,
                   job: str | None = None) -> None:
    """Refuse, before anything starts, the data a run would fail on: every problem ``pflseg data check`` reports of
    the run's sites (``choose_sites``), in its words. A post-training job (it adapts at its sites, e.g. routing at an
    outside site) lets an empty validation or test split pass, as a site does (``pflseg.data.check.NOT_REFUSED``).

    Raises:
        DataError: naming every problem, its file, its site and its fix, and the command that lists them again.
    """
    from pflseg.config import load_job_config
    from pflseg.data import DataError, check_dataset
    from pflseg.data.check import NOT_REFUSED
    from pflseg.flare.methods import METHODS

    root = Path(data).resolve()
    sites = choose_sites(root, n, names)
    post_training = False
    if job is not None:
        entry = METHODS.get(load_job_config(job)["method"])
        post_training = entry is not None and entry.after is not None
    problems = [p for p in check_dataset(root, sites) if not (post_training and p.code in NOT_REFUSED)]
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise DataError(f"--data {root}: {len(problems)} problem(s) in the run's sites {', '.join(sites)}; nothing "
                        f"was started:\n{lines}\n`pflseg data check {root}` lists them again once fixed", problems)
