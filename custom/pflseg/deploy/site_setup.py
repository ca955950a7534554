"""A deployed site sets itself up: `pflseg site init` writes its site-local settings, `pflseg site check` reads them
back (``pflseg.flare.settings``: where the data is, the device, the state folder and the site's policy).

A site's FLARE name is its startup kit folder's name unless given: provisioning names each kit after its site.
"""

from __future__ import annotations

from pathlib import Path

from pflseg.flare.settings import init_site, site_report


def site_name(site_dir: str | Path, name: str | None = None) -> str:
    """``name``, else the name of the kit folder ``site_dir``."""
    return name or Path(site_dir).resolve().name


def site_policy(methods: list[str] | None = None, no_per_case: bool = False, no_round_test: bool = False,
                no_publish: bool = False, allow_pooling: bool = False, allow_two_sites: bool = False) -> dict:
    """The policy a site writes (``pflseg.flare.policy``): only what it restricts or allows beyond the default
    (allow what the job asks; refuse pooling and two-site jobs).

    Example: ``site_policy(["fedavg"], no_publish=True)`` -> ``{"methods": ["fedavg"], "publish": False}``.
    """
    policy = {"methods": methods, "per_case": False if no_per_case else None,
              "round_test": False if no_round_test else None, "publish": False if no_publish else None,
              "pooling": True if allow_pooling else None, "two_sites": True if allow_two_sites else None}
    return {key: value for key, value in policy.items() if value is not None}


def site_init(site_dir: str | Path, data: str | Path, name: str | None = None, data_site: str | None = None,
              device: str = "auto", state_dir: str | Path | None = None, policy: dict | None = None,
              say=print) -> Path:
    """Check, then write the site's settings (``pflseg.flare.settings.init_site``) and ``say`` where.

    Returns:
        The settings file written.

    Raises:
        ValueError: the settings would not work (every problem named); nothing is written.
    """
    name = site_name(site_dir, name)
    target, problems = init_site(site_dir, name, data, data_site, device, state_dir, policy)
    if problems:
        raise ValueError(f"site {name}: nothing written to {target}:\n" + "\n".join(f"  - {p}" for p in problems))
    say(f"wrote {target} (mode 0600); check it with `pflseg site check --site-dir {site_dir}`")
    return target


def site_check(site_dir: str | Path, name: str | None = None, say=print) -> bool:
    """``say`` the site's settings and policy and whether its data validates (``site_report``); True when it
    does."""
    lines, problems = site_report(site_dir, site_name(site_dir, name))
    say("\n".join(lines))
    return not problems
