"""The site's own policy: what it runs and what may leave it. The job (from the server) only asks.

A site's policy is the ``policy`` object of its site-local settings (``local/pflseg_site.json``, written by
``pflseg site init``; ``pflseg.flare.settings``). Every key is optional:

==================  =======  ==============================================================================
key                 default  the site allows
==================  =======  ==============================================================================
``methods``         null     these methods only (names of ``pflseg.flare.methods.METHODS``); null: any
``per_case``        true     Dice per case (pseudonymised) in its replies (the job's ``privacy.per_case``)
``round_test``      true     per-round test scores, IOP-FL's (the job's ``privacy.round_test``)
``publish``         true     its personalized model leaving it (what a method sends: its site class's
                             ``personal_models_sent``): IOP-FL's best P_k at the end (``iopfl.publish``), FedSM's
                             personalized model every round, LC-Fed's coarse head every round (HC)
``pooling``         null     training on the folders of OTHER sites in its data root (Centralized); null:
                             in the simulator only
``two_sites``       false    a deployment's training job of exactly two sites (K = 2: what a site receives
                             gives it the other site's model, docs/privacy.md); the simulator
                             runs K = 2 regardless
==================  =======  ==============================================================================

Synthetic data: a site with no data configured makes the job's synthetic data set only in the simulator, or when
the job opts in (``data.allow_synthetic: true``); a deployed site refuses the job otherwise, naming the fix.

Where it is checked: ``check_task`` before the site is made from the job's first message and before every task
(``pflseg.flare.client.answer``), ``check_publish`` in IOP-FL's ``submit_model``, ``check_pooling`` where
Centralized decides what it pools. The defaults allow what the job asks, so the simulator's results do not
change; only K = 2, pooling and the synthetic fall-back are refused in a deployment by default.

In the simulator or not: FLARE's simulator (``nvflare simulator``, ``pflseg run``, SimEnv) runs every job under
the job id ``simulate_job`` (FLARE's own tracking receivers tell the simulator by it); a POC or provisioned site
gets the job's real id. A site called in-process without FLARE (tests) has no job id: as in the simulator.
"""

from __future__ import annotations

#: the job id of every job FLARE's simulator runs (``nvflare.private.fed.simulator.simulator_const``)
SIMULATOR_JOB_ID = "simulate_job"

#: key -> (default, kind, what it allows): kind "bool", "optional bool" (null = simulator only) or "methods"
POLICY = {
    "methods": (None, "methods", "the methods this site runs"),
    "per_case": (True, "bool", "Dice per case (pseudonymised) in the site's replies"),
    "round_test": (True, "bool", "IOP-FL's per-round test scores in the site's replies"),
    "publish": (True, "bool", "the site's personalized model leaving the site"),
    "pooling": (None, "optional bool", "training on other sites' folders of the site's data root (Centralized)"),
    "two_sites": (False, "bool", "a deployment's training job of exactly two sites"),
}


class PolicyError(ValueError):
    """The site's policy refuses what the job asks; names the site, the settings file, the key and the fix."""


def deployed(job_id: str | None) -> bool:
    """Whether a site runs in a POC or provisioned deployment (a FLARE job id other than the simulator's)."""
    return job_id is not None and job_id != SIMULATOR_JOB_ID


def check_policy(policy, source: str, site: str = "this site") -> dict:
    """The effective policy: ``policy`` (the settings' ``policy`` object, may be None) over the defaults.

    Raises:
        PolicyError: an unknown key or a value of the wrong kind, naming the file and the key.
    """
    if policy is None:
        policy = {}
    if not isinstance(policy, dict):
        raise PolicyError(f"site {site}: 'policy' in {source} must be an object of {', '.join(POLICY)}, got "
                          f"{policy!r}; rewrite it with `pflseg site init`")
    unknown = sorted(set(policy) - set(POLICY))
    if unknown:
        raise PolicyError(f"site {site}: {source} has unknown policy key(s) {unknown}; known: {', '.join(POLICY)}")
    out = {key: default for key, (default, _, _) in POLICY.items()}
    for key, value in policy.items():
        kind = POLICY[key][1]
        if kind == "bool":
            ok = isinstance(value, bool)
        elif kind == "optional bool":
            ok = value is None or isinstance(value, bool)
        else:
            ok = value is None or (isinstance(value, list) and all(isinstance(m, str) for m in value))
        if not ok:
            want = {"bool": "true or false", "optional bool": "true, false or null",
                    "methods": "null or a list of method names"}[kind]
            raise PolicyError(f"site {site}: policy.{key} in {source} must be {want}, got {value!r}")
        out[key] = value
    if out["methods"] is not None:
        from pflseg.flare.methods import METHODS

        wrong = [m for m in out["methods"] if m not in METHODS]
        if wrong:
            raise PolicyError(f"site {site}: policy.methods in {source} names unknown method(s) {wrong}; "
                              f"known: {', '.join(METHODS)}")
    return out


def _refuse(site: str, settings: dict, key: str, what: str, fix: str) -> PolicyError:
    shown = _shown(settings["policy"][key], POLICY[key][1])
    return PolicyError(f"site {site}: the site's policy refuses {what} (policy.{key}: {shown}, from "
                       f"{settings.get('policy_source', settings['source'])}); {fix}")


def check_task(site: str, task: str, cfg: dict, sites: list[str], settings: dict, job_id: str | None) -> None:
    """Refuse what the site's policy does not allow in job ``cfg`` (the server's config) with ``sites``, before
    the site is made and before every task (``pflseg.flare.client.answer``).

    Raises:
        PolicyError: names the site, the setting (key and file) and what the job or the site can change.
    """
    from pflseg.flare.methods import method as registered

    policy, method, on_prod = settings["policy"], cfg["method"], deployed(job_id)
    entry = registered(cfg)
    if policy["methods"] is not None and method not in policy["methods"]:
        raise _refuse(site, settings, "methods", f"method '{method}' (job {cfg['name']})",
                      "submit a job of an allowed method, or add it at the site (`pflseg site init --methods ...`)")
    privacy = cfg["privacy"]
    if privacy["per_case"] and not policy["per_case"]:
        raise _refuse(site, settings, "per_case", "Dice per case (the job asks privacy.per_case: true)",
                      "run the job with privacy.per_case: false")
    if privacy["round_test"] and not policy["round_test"]:
        raise _refuse(site, settings, "round_test", "per-round test scores (the job asks privacy.round_test: true)",
                      "run the job with privacy.round_test: false")
    sent = entry.site.personal_models_sent(cfg)
    if sent and not policy["publish"]:
        raise _refuse(site, settings, "publish", f"sending {sent}", "run the job with the setting that keeps it at "
                      "the site (e.g. iopfl.publish: false, lcfed.hc: false), or a method that does (e.g. fedbn)")
    exchanges = entry.site.exchanges_models and entry.after is None  # post-training jobs: a published bundle
    if on_prod and len(sites) == 2 and exchanges and not policy["two_sites"]:
        raise _refuse(site, settings, "two_sites", f"a {method} job of exactly two sites ({', '.join(sites)}): "
                      "what a site receives gives it the other site's model (docs/privacy.md: two sites are one too "
                      "few)",
                      "run the job with three or more sites, or allow it at the site (`pflseg site init "
                      "--allow-two-sites`)")
    if task == "submit_model":
        check_publish(site, cfg, settings)
    if settings["data"] is None and on_prod and not cfg["data"].get("allow_synthetic"):
        where = settings.get("policy_source", settings["source"])
        raise PolicyError(f"site {site}: no data configured at this site ({where}), and the job does not "
                          "opt in to synthetic data (data.allow_synthetic); configure the site's data with `pflseg "
                          "site "
                          "init --data DIR`, or, for a test federation, run the job with data.allow_synthetic: true")


def check_publish(site: str, cfg: dict, settings: dict) -> None:
    """Before IOP-FL's ``submit_model`` hands out P_k: the job must publish it (``iopfl.publish``) and the site's
    policy allow it (``publish``)."""
    if not cfg["iopfl"]["publish"]:
        raise PolicyError(f"site {site}: refusing submit_model: job {cfg['name']} has iopfl.publish: false, so P_k "
                          "stays at the site; run the job with iopfl.publish: true to build a routing bundle")
    if not settings["policy"]["publish"]:
        raise _refuse(site, settings, "publish", "handing out its P_k (task submit_model)",
                      "run the job with iopfl.publish: false")


def check_pooling(site: str, others: list[str], settings: dict, job_id: str | None) -> None:
    """Before a site trains on ``others``, other sites' folders of its data root (Centralized): ``policy.pooling``
    true, or null and the simulator."""
    if not others:
        return
    allowed = settings["policy"]["pooling"]
    if allowed is None:
        allowed = not deployed(job_id)
    if not allowed:
        raise _refuse(site, settings, "pooling", f"training on other sites' folders {others} of its data root "
                      "(Centralized pools every site's data at one site)",
                      "run Centralized in the simulator only, or allow it at the site (`pflseg site init "
                      "--allow-pooling`)")


def synthetic_allowed(data_cfg: dict, job_id: str | None) -> bool:
    """Whether a site with no data configured may make the job's synthetic data set: in the simulator, or when the
    job opts in (``data.allow_synthetic``)."""
    return not deployed(job_id) or bool(data_cfg.get("allow_synthetic"))


def describe(policy: dict) -> list[str]:
    """One line per policy key: its value and what it allows (``pflseg site check``)."""
    lines = []
    for key, (default, kind, what) in POLICY.items():
        value = policy[key]
        note = "" if value == default else f" (default: {_shown(default, kind)})"
        lines.append(f"  {key}: {_shown(value, kind)}{note} -- {what}")
    return lines


def _shown(value, kind: str = "bool") -> str:
    if value is None:
        return "null (in the simulator only)" if kind == "optional bool" else "null (any)"
    if isinstance(value, bool):
        return str(value).lower()
    return ", ".join(value) if isinstance(value, list) else str(value)
