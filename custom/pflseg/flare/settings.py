"""What a site knows about itself, from its own local configuration (never from the job).

Site-local settings, first found wins:
  1. ``$PFLSEG_SITE_CONFIG`` (a JSON file), else ``./local/pflseg_site.json``, else ``./pflseg_site.json``
     (``./`` = the site's working directory; ``pflseg site init`` writes it), with keys
     ``data`` (a data root made by ``pflseg data synth|index``), ``data_site`` (the site's folder name
     inside it, default: the FLARE site name), ``device`` (``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``),
     ``state_dir`` (where personalized state and checkpoints live; may lie outside the kit), ``threads`` (torch
     CPU threads; 0 = torch's default), ``policy`` (what the site runs and lets leave it: ``pflseg.flare.policy``);
  2. environment ``PFLSEG_DATA``, ``PFLSEG_DEVICE`` and ``PFLSEG_THREADS`` override ``data``, ``device`` and
     ``threads`` (``pflseg run`` sets them: several simulated sites share one machine).

With no data configured at all, the site makes the job's deterministic synthetic data set in its
workspace and says so in its log (in the simulator; a POC or provisioned site only when the job opts in,
``data.allow_synthetic``: ``pflseg.flare.policy.check_task``); a data location that is configured but missing or
invalid is an error that names the site, the path and the fix: never a silent fall-back. ``check_site`` (``pflseg
site init`` and ``site check``) says what is wrong with a site's settings before any job runs.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection
from pathlib import Path

from pflseg.data import DataError, check_dataset, load_dataset_info, make_synthetic, require_valid
from pflseg.flare.policy import check_policy, describe
from pflseg.flare.state import private_dir, write_text

log = logging.getLogger("pflseg.site")
KEYS = ("data", "data_site", "device", "state_dir", "threads", "policy")
SETTINGS_FILE = "pflseg_site.json"


def site_settings(site: str, folder: str | Path | None = None, registered: Collection[str] | None = None) -> dict:
    """Site-local settings (see module docstring) plus ``source``: where they came from (``policy_source``: where
    the policy came from). ``folder``: the site's working directory (default: the current one); ``registered``: the
    registered method names, which ``policy.methods`` must be among (``pflseg.flare.policy.check_policy``)."""
    settings = {"data": None, "data_site": None, "device": "auto", "state_dir": None, "threads": 0, "policy": None,
                "source": "defaults", "policy_source": "defaults (no site settings file)"}
    env_file = os.environ.get("PFLSEG_SITE_CONFIG")
    base = Path(folder or ".")
    candidates = [Path(env_file)] if env_file else [base / "local" / SETTINGS_FILE, base / SETTINGS_FILE]
    for path in candidates:
        if path.is_file():
            try:
                loaded = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise DataError(f"site {site}: site config {path.resolve()} is not valid JSON ({exc}); "
                                f"rewrite it with `pflseg site init`") from exc
            if not isinstance(loaded, dict):
                raise DataError(f"site {site}: site config {path.resolve()} holds {type(loaded).__name__}, not an "
                                f"object of {', '.join(KEYS)}; rewrite it with `pflseg site init`")
            unknown = set(loaded) - set(KEYS)
            if unknown:
                raise DataError(f"site {site}: site config {path.resolve()} has unknown key(s) {sorted(unknown)}; "
                                f"known: {', '.join(KEYS)}")
            settings.update(loaded)
            settings["source"] = settings["policy_source"] = str(path.resolve())
            break
        if env_file:
            raise DataError(f"site {site}: PFLSEG_SITE_CONFIG={env_file} does not exist; fix the path or unset it")
    if os.environ.get("PFLSEG_DATA"):
        settings["data"], settings["source"] = os.environ["PFLSEG_DATA"], "environment PFLSEG_DATA"
    if os.environ.get("PFLSEG_DEVICE"):
        settings["device"] = os.environ["PFLSEG_DEVICE"]
    if os.environ.get("PFLSEG_THREADS"):
        settings["threads"] = int(os.environ["PFLSEG_THREADS"])
    settings["policy"] = check_policy(settings["policy"], settings["policy_source"], site, registered)
    return settings


def init_site(site_dir: str | Path, site: str, data: str | Path, data_site: str | None = None,
              device: str | None = None, state_dir: str | Path | None = None, policy: dict | None = None,
              threads: int | None = None, say=None,
              registered: Collection[str] | None = None) -> tuple[Path, list[str], list[str]]:
    """Check, then write ``<site_dir>/local/pflseg_site.json`` (mode 0600) for FLARE site ``site``
    (``pflseg site init``); a ``state_dir`` is made with mode 0700 (it may lie outside the kit). What is not given
    here (None: ``data_site``, ``device``, ``state_dir``, ``threads``, each key of ``policy``) keeps the value of
    the settings file already there, e.g. the ``threads`` ``pflseg deploy local`` wrote; ``device`` is ``auto``
    when neither says. ``registered``: the registered method names, which ``policy.methods`` must be among.

    Returns:
        ``(settings file, problems, kept)``: nothing is written when there are problems (``check_site``); ``kept``
        names the earlier settings kept (``threads=2``, ``policy.methods``).

    Raises:
        PolicyError: ``policy`` has an unknown key, a value of the wrong kind or an unknown method.
        DataError: the settings file there is not valid (named, with the fix).
    """
    target = Path(site_dir) / "local" / SETTINGS_FILE
    earlier = _earlier_settings(target, site)
    given = {"data": str(Path(data).expanduser().resolve()), "data_site": data_site, "device": device,
             "state_dir": str(Path(state_dir).expanduser().resolve()) if state_dir else None, "threads": threads}
    body = {k: v for k, v in earlier.items() if k != "policy"}
    body.update({k: v for k, v in given.items() if v is not None})
    body.setdefault("device", "auto")
    merged_policy = {**(earlier.get("policy") or {}), **(policy or {})}
    if merged_policy:
        body["policy"] = merged_policy
    kept = [f"{k}={earlier[k]}" for k in ("data_site", "device", "state_dir", "threads")
            if k in earlier and given[k] is None]
    kept += [f"policy.{k}" for k in (earlier.get("policy") or {}) if k not in (policy or {})]
    settings = {"data_site": None, "state_dir": None, "threads": 0, **body,
                "policy": check_policy(merged_policy or None, str(target), site, registered)}
    problems = check_site(site, settings, say)  # say: progress lines while the site's files are read
    if problems:
        return target, problems, kept
    private_dir(target.parent)
    if body.get("state_dir"):
        private_dir(body["state_dir"])
    write_text(target, json.dumps(body, indent=1) + "\n")
    return target, [], kept


def _earlier_settings(target: Path, site: str) -> dict:
    """The settings file ``target`` as it is (``{}`` when there is none)."""
    if not target.is_file():
        return {}
    try:
        earlier = json.loads(target.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"site {site}: {target} is not valid JSON ({exc}); move it away, then run `pflseg site init` "
                        "again") from exc
    unknown = set(earlier) - set(KEYS) if isinstance(earlier, dict) else set()
    if not isinstance(earlier, dict) or unknown:
        raise DataError(f"site {site}: {target} is not a settings file of {', '.join(KEYS)}"
                        + (f" (unknown key(s) {sorted(unknown)})" if unknown else "")
                        + "; move it away, then run `pflseg site init` again")
    return earlier


def site_report(site_dir: str | Path, site: str, say=None,
                registered: Collection[str] | None = None) -> tuple[list[str], list[str]]:
    """What the site in ``site_dir`` runs with (``pflseg site check``): ``(lines, problems)``, lines naming its
    settings, where its state goes, its policy and whether its data validates (``registered``: the registered method
    names, which ``policy.methods`` must be among)."""
    settings = site_settings(site, site_dir, registered)
    state_root = (f"{os.environ['PFLSEG_STATE_DIR']}/{site} (environment PFLSEG_STATE_DIR)"
                  if os.environ.get("PFLSEG_STATE_DIR") else settings["state_dir"]
                  or f"{Path(site_dir).resolve() / 'pflseg_state'} (default: inside the kit)")
    lines = [f"site {site}: settings from {settings['policy_source']}",
             f"  data: {settings['data'] or 'none (synthetic, in the simulator or when a job opts in)'}"
             f"{' (' + settings['source'] + ')' if settings['source'] != settings['policy_source'] else ''}",
             f"  data site: {settings['data_site'] or site}", f"  device: {settings['device']}",
             f"  state: {state_root}", f"  threads: {settings['threads'] or 'torch default'}",
             "policy (what this site runs and lets leave it):", *describe(settings["policy"])]
    problems = check_site(site, settings, say)
    lines.append("data: valid" if not problems else f"{len(problems)} problem(s):")
    return lines + [f"  - {p}" for p in problems], problems


def data_source(settings: dict) -> str:
    """Where the site's data comes from, in words that may leave the site (results.json, the admin's table):
    ``synthetic`` (none configured: the job's synthetic data set) or ``site data``."""
    return "synthetic" if settings["data"] is None else "site data"


def check_site(site: str, settings: dict, say=None) -> list[str]:
    """What is wrong with ``site``'s settings (``site_settings``), one line each with the fix; empty when its data
    location holds a valid data root with the site's folder and its device exists here."""
    problems = []
    device = str(settings.get("device") or "auto")
    if device not in ("auto", "cpu") and not (device == "cuda"
                                              or (device.startswith("cuda:") and device[5:].isdigit())):
        problems.append(f"device '{device}' is not auto, cpu, cuda or cuda:N; pass --device auto")
    elif device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device[5:]) if ":" in device else 0
        if index >= count:
            problems.append(f"device '{device}': this machine has {count} CUDA device(s) visible "
                            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use auto or cpu")
    if settings["data"] is None:
        problems.append("no data configured: a deployed site refuses jobs that do not opt in to synthetic data "
                        "(data.allow_synthetic); set it with `pflseg site init --data DIR`")
        return problems
    root = Path(settings["data"]).expanduser()
    if not root.is_dir():
        return problems + [f"data location {root} does not exist; prepare it with `pflseg data index|synth` or fix "
                           "--data"]
    try:
        info = load_dataset_info(root)
    except DataError as exc:
        return problems + [f"data location {root} is not a data root: {exc}; make one with `pflseg data index`"]
    data_site = settings.get("data_site") or site
    if data_site not in info["sites"]:
        return problems + [f"data root {root} has no site folder '{data_site}' (it holds {info['sites']}); pass "
                           f"--data-site with one of them"]
    for problem in check_dataset(root, [data_site], say=say):  # the site's own data (``say``: progress lines)
        if problem.site in ("", data_site):
            problems.append(f"data: {problem}")
    return problems


def synthetic_root(data_cfg: dict, base: Path | None = None) -> Path:
    """Folder of the job's synthetic data set inside the site workspace (made once, then reused)."""
    name = f"{data_cfg['synth_task']}-n{data_cfg['synth_sites']}-seed{data_cfg['synth_seed']}"
    return (base or Path.cwd()) / "pflseg_synth" / name


def resolve_data(site: str, settings: dict, data_cfg: dict, sites: list[str] | None = None) -> tuple[Path, str]:
    """Return ``(data_root, data_site)`` for ``site``, validated; make synthetic data when none is configured.

    Args:
        sites: when given, every one of these must be present too (centralized training pools them).
    """
    if settings["data"] is None:
        root = synthetic_root(data_cfg)
        if not (root / "dataset.json").is_file():
            log.info("site %s: no data configured; making synthetic %s data in %s", site, data_cfg["synth_task"], root)
            make_synthetic(root, task=data_cfg["synth_task"], n_sites=data_cfg["synth_sites"],
                           seed=data_cfg["synth_seed"])
        source = "synthetic default (no data configured at this site)"
    else:
        root = Path(settings["data"]).expanduser()
        source = settings["source"]
        if not root.is_dir():
            raise DataError(
                f"site {site}: data location {root} (from {source}) does not exist; "
                f"fix the path with `pflseg site init --data DIR` or prepare it with `pflseg data synth|index`"
            )
    data_site = settings.get("data_site") or site
    info = load_dataset_info(root)
    needed = [data_site] + [s for s in (sites or []) if s != site]
    missing = [s for s in needed if s not in info["sites"]]
    if missing:
        raise DataError(
            f"site {site}: data root {root} (from {source}) has no site(s) {missing}; it holds {info['sites']}. "
            f"Set data_site in the site config, or run the job with at most {len(info['sites'])} sites"
        )
    require_valid(root, needed)  # this site's own data (and the pooled sites'): a bad file elsewhere is not its problem
    return root, data_site
