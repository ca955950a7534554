"""A deployed site sets itself up: `pflseg site init` writes its site-local settings, `pflseg site check` reads them
back (``pflseg.flare.settings``: where the data is, the device, the state folder and the site's policy).

A site's FLARE name is its startup kit folder's name unless given: provisioning names each kit after its site.
"""

from __future__ import annotations

from pathlib import Path

from pflseg.flare.methods import METHODS
from pflseg.flare.settings import init_site, site_report


def site_name(site_dir: str | Path, name: str | None = None) -> str:
    """``name``, else the name of the kit folder ``site_dir``."""
    return name or Path(site_dir).resolve().name


#: ``site_policy``'s flags (``pflseg site init``'s options, by their argparse names)
POLICY_FLAGS = ("no_per_case", "no_round_test", "no_publish", "allow_pooling", "allow_two_sites", "allow_per_case",
                "allow_remote_tracking", "require_dp", "min_noise_multiplier", "min_batch_size",
                "max_evaluations_per_job", "max_image_size", "max_rounds_x_epochs", "max_memory_gib")


def site_policy(methods: list[str] | None = None, no_per_case: bool = False, no_round_test: bool = False,
                no_publish: bool = False, allow_pooling: bool = False, allow_two_sites: bool = False,
                allow_per_case: bool = False, allow_remote_tracking: bool = False, require_dp: bool = False,
                **bounds) -> dict:
    """The policy a site writes (``pflseg.flare.policy``): only what it restricts or allows beyond the default.
    ``bounds``: policy keys with a number (``min_noise_multiplier``, ``min_batch_size``, ``max_evaluations_per_job``,
    ``max_image_size``, ``max_rounds_x_epochs``, ``max_memory_gib``); None: the default.

    Example: ``site_policy(["fedavg"], no_publish=True, require_dp=True)`` -> ``{"methods": ["fedavg"], "publish":
    False, "require_dp": True}``.
    """
    if no_per_case and allow_per_case:
        raise ValueError("--no-per-case and --allow-per-case contradict each other: pass one")
    policy = {"methods": methods, "per_case": False if no_per_case else True if allow_per_case else None,
              "round_test": False if no_round_test else None, "publish": False if no_publish else None,
              "pooling": True if allow_pooling else None, "two_sites": True if allow_two_sites else None,
              "remote_tracking": True if allow_remote_tracking else None, "require_dp": True if require_dp else None,
              **bounds}
    return {key: value for key, value in policy.items() if value is not None}


def require_kit(site_dir: str | Path) -> Path:
    """``site_dir`` if it is a FLARE site's startup kit (``startup/fed_client.json``, as provisioning makes it).

    Raises:
        ValueError: it is not (the server's or an admin's kit, or another folder), naming it and the fix.
    """
    kit = Path(site_dir).resolve()
    startup = kit / "startup"
    if (startup / "fed_client.json").is_file():
        return kit
    if (startup / "fed_server.json").is_file():
        what = "the server's startup kit, not a site's"
    elif (startup / "fed_admin.json").is_file():
        what = "an admin's startup kit, not a site's"
    else:
        what = "not a FLARE site's startup kit (no startup/fed_client.json)"
    raise ValueError(f"--site-dir {kit} is {what}: run this in the site's kit folder (the one provisioning made for "
                     "the site, e.g. <provision workspace>/prod_00/site-1), or pass that folder with --site-dir")


def site_init(site_dir: str | Path, data: str | Path, name: str | None = None, data_site: str | None = None,
              device: str | None = None, state_dir: str | Path | None = None, policy: dict | None = None,
              threads: int | None = None, say=print) -> Path:
    """Check, then write the site's settings (``pflseg.flare.settings.init_site``: what is not given keeps its earlier
    value) in the site's kit (``require_kit``) and ``say`` where and what was kept.

    Returns:
        The settings file written.

    Raises:
        ValueError: ``site_dir`` is not a site's kit, or the settings would not work (every problem named);
            nothing is written.
    """
    require_kit(site_dir)
    name = site_name(site_dir, name)
    target, problems, kept = init_site(site_dir, name, data, data_site, device, state_dir, policy, threads,
                                       say, registered=METHODS)
    if problems:
        raise ValueError(f"site {name}: nothing written to {target}:\n" + "\n".join(f"  - {p}" for p in problems))
    say(f"wrote {target} (mode 0600)" + (f"; kept from the earlier settings: {', '.join(kept)}" if kept else "")
        + f"; check it with `pflseg site check --site-dir {site_dir}`")
    return target


def site_check(site_dir: str | Path, name: str | None = None, say=print) -> bool:
    """``say`` the site's settings and policy and whether its data validates (``site_report``); True when it
    does.

    Raises:
        ValueError: ``site_dir`` is not a site's kit (``require_kit``).
    """
    require_kit(site_dir)
    lines, problems = site_report(site_dir, site_name(site_dir, name), say,  # progress while its files are read
                                  registered=METHODS)
    say("\n".join(lines))
    return not problems
