"""What a site knows about itself, from its own local configuration (never from the job).

Site-local settings, first found wins:
  1. ``$PFLSEG_SITE_CONFIG`` (a JSON file), else ``./local/pflseg_site.json``, else ``./pflseg_site.json``
     (``./`` = the site's working directory; ``pflseg site init`` writes it), with keys
     ``data`` (a data root made by ``pflseg data synth|index``), ``data_site`` (the site's folder name
     inside it, default: the FLARE site name), ``device`` (``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``),
     ``state_dir`` (where personalized state and checkpoints live), ``threads`` (torch CPU threads; 0 =
     torch's default);
  2. environment ``PFLSEG_DATA``, ``PFLSEG_DEVICE`` and ``PFLSEG_THREADS`` override ``data``, ``device`` and
     ``threads`` (``pflseg run`` sets them: several simulated sites share one machine).

With no data configured at all, the site makes the job's deterministic synthetic data set in its
workspace and says so in its log; a data location that is configured but missing or invalid is an error
that names the site, the path and the fix: never a silent fall-back.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from pflseg.data import DataError, load_dataset_info, make_synthetic, require_valid

log = logging.getLogger("pflseg.site")
KEYS = ("data", "data_site", "device", "state_dir", "threads")


def site_settings(site: str) -> dict:
    """Site-local settings (see module docstring) plus ``source``: where they came from."""
    settings = {"data": None, "data_site": None, "device": "auto", "state_dir": None, "threads": 0, "source": "defaults"}
    env_file = os.environ.get("PFLSEG_SITE_CONFIG")
    candidates = [Path(env_file)] if env_file else [Path("local/pflseg_site.json"), Path("pflseg_site.json")]
    for path in candidates:
        if path.is_file():
            try:
                loaded = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise DataError(f"site {site}: site config {path.resolve()} is not valid JSON ({exc}); "
                                f"rewrite it with `pflseg site init`") from exc
            unknown = set(loaded) - set(KEYS)
            if unknown:
                raise DataError(f"site {site}: site config {path.resolve()} has unknown key(s) {sorted(unknown)}; "
                                f"known: {', '.join(KEYS)}")
            settings.update(loaded)
            settings["source"] = str(path.resolve())
            break
        if env_file:
            raise DataError(f"site {site}: PFLSEG_SITE_CONFIG={env_file} does not exist; fix the path or unset it")
    if os.environ.get("PFLSEG_DATA"):
        settings["data"], settings["source"] = os.environ["PFLSEG_DATA"], "environment PFLSEG_DATA"
    if os.environ.get("PFLSEG_DEVICE"):
        settings["device"] = os.environ["PFLSEG_DEVICE"]
    if os.environ.get("PFLSEG_THREADS"):
        settings["threads"] = int(os.environ["PFLSEG_THREADS"])
    return settings


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
            make_synthetic(root, task=data_cfg["synth_task"], n_sites=data_cfg["synth_sites"], seed=data_cfg["synth_seed"])
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
    require_valid(root)
    return root, data_site
