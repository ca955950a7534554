"""The site's own policy: what it runs and what may leave it. The job (from the server) only asks.

A site's policy is the ``policy`` object of its site-local settings (``local/pflseg_site.json``, written by
``pflseg site init``; ``pflseg.flare.settings``). Every key is optional:

===========================  =======  ============================================================================
key                          default  the site allows
===========================  =======  ============================================================================
``methods``                  null     these methods only (names of ``pflseg.flare.methods.METHODS``: checked where
                                      the registry is, ``check_policy``'s ``registered``); null: any
``per_case``                 null*    Dice per case (pseudonymised) in its replies (the job's ``privacy.per_case``)
``round_test``               true     per-round test scores, IOP-FL's (the job's ``privacy.round_test``)
``publish``                  true     its personalized model leaving it (what a method sends: its site class's
                                      ``personal_models_sent``): IOP-FL's best P_k at the end (``iopfl.publish``),
                                      FedSM's personalized model every round, LC-Fed's coarse head every round (HC)
``pooling``                  null*    training on the folders of OTHER sites in its data root (Centralized)
``two_sites``                false    a deployment's training job of exactly two sites (K = 2: what a site receives
                                      gives it the other site's model, docs/privacy.md); the simulator
                                      runs K = 2 regardless
``require_dp``               false    true: only training jobs whose model updates leave with DP
                                      (``privacy.update.dp``: a clip and noise_multiplier > 0)
``min_noise_multiplier``     0        with DP required: ``privacy.update.dp.noise_multiplier`` at least this
``min_batch_size``           null*    training jobs with ``train.batch_size`` at least this
``max_evaluations_per_job``  null*    scoring tasks answered per FLARE job (``EVALUATION_TASKS``: validate, test, ...)
``max_image_size``           null*    ``data.size`` (the slice side in pixels) at most this
``max_rounds_x_epochs``      null*    ``rounds`` x ``train.epochs`` at most this
``max_memory_gib``           null*    the job's memory estimate (feature maps of one batch, the slice cache:
                                      ``pflseg.config.check_memory``) within this many GiB
``remote_tracking``          null*    the job's tracking sending the site's metrics off the server's machine: an
                                      MLflow URI of another host, W&B online (``remote_tracking_target``)
===========================  =======  ============================================================================

null*: the value depends on where the site runs (``UNSET``: simulator, deployment): per_case, pooling and
remote_tracking allowed in the simulator only; min_batch_size 4, max_evaluations_per_job 2 (a training job's final
validate and test, a post-training job's one or two), max_image_size 512, max_rounds_x_epochs 10000 and
max_memory_gib this machine's memory (the GPU's for the feature maps of a CUDA site) in a deployment, no bound in
the simulator. A site's own value, true / false or a number, holds everywhere.

Synthetic data: a site with no data configured makes the job's synthetic data set only in the simulator, or when
the job opts in (``data.allow_synthetic: true``); a deployed site refuses the job otherwise, naming the fix.

Where it is checked: ``check_task`` before the site is made from the job's first message and before every task
(``pflseg.flare.client.answer``), ``check_publish`` in IOP-FL's ``submit_model``, ``check_pooling`` where
Centralized decides what it pools. The defaults allow what the job asks, so the simulator's results do not
change; in a deployment the null* defaults above refuse what a job could extract (per-case Dice, repeated scoring,
metrics to a remote tracker, absurd sizes), as do K = 2, pooling and the synthetic fall-back.

Whose bundle: a training job's state folder at a site records who submitted it (``ORIGIN``: FLARE's job meta,
``submitter_name`` and ``study``; ``record_origin``). A deployed post-training job reads a bundle only of its own
submitter's jobs, or of a job of the same (non-default) FLARE study (``check_bundle_origin``): at the site for the
own model cross-site evaluation reads from the site's state (``check_task``), at the server where a controller
reads its bundle (``PostTrainingController.bundle_folder``).

In the simulator or not: FLARE's simulator (``nvflare simulator``, ``pflseg run``, SimEnv) runs every job under
the job id ``simulate_job`` (FLARE's own tracking receivers tell the simulator by it); a POC or provisioned site
gets the job's real id. A site called in-process without FLARE (tests) has no job id: as in the simulator.
"""


from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from urllib.parse import urlsplit

#: the job id of every job FLARE's simulator runs (``nvflare.private.fed.simulator.simulator_const``)
SIMULATOR_JOB_ID = "simulate_job"

#: key -> (default, kind, what it allows): kind "bool", "optional bool" (null: ``UNSET``), "methods", "count" (null or
#: an integer >= 1) or "number" (a number >= 0; "optional number": null too)
POLICY = {
    "methods": (None, "methods", "the methods this site runs"),
    "per_case": (None, "optional bool", "Dice per case (pseudonymised) in the site's replies"),
    "round_test": (True, "bool", "IOP-FL's per-round test scores in the site's replies"),
    "publish": (True, "bool", "the site's personalized model leaving the site"),
    "pooling": (None, "optional bool", "training on other sites' folders of the site's data root (Centralized)"),
    "two_sites": (False, "bool", "a deployment's training job of exactly two sites"),
    "require_dp": (False, "bool", "true: only training jobs whose model updates leave with DP (privacy.update.dp)"),
    "min_noise_multiplier": (0.0, "number", "with DP required, privacy.update.dp.noise_multiplier at least this"),
    "min_batch_size": (None, "count", "training jobs with train.batch_size at least this"),
    "max_evaluations_per_job": (None, "count", "scoring tasks (validate, test, ...) answered per FLARE job"),
    "max_image_size": (None, "count", "data.size (slice side, pixels) at most this"),
    "max_rounds_x_epochs": (None, "count", "rounds x train.epochs at most this"),
    "max_memory_gib": (None, "optional number", "the job's memory estimate (feature maps, slice cache) within this"),
    "remote_tracking": (None, "optional bool", "the job's tracking sending metrics to another host (MLflow URI, W&B "
                                               "online)"),
}
#: what a null value means: key -> (in the simulator, in a deployment); None: no bound. max_memory_gib's "machine":
#: this machine's memory (``pflseg.config.machine_memory``)
UNSET = {
    "per_case": (True, False),
    "pooling": (True, False),
    "remote_tracking": (True, False),
    "min_batch_size": (None, 4),
    "max_evaluations_per_job": (None, 2),
    "max_image_size": (None, 512),
    "max_rounds_x_epochs": (None, 10_000),
    "max_memory_gib": (None, "machine"),
}
#: tasks that score a model on the site's data (their replies carry Dice): counted for ``max_evaluations_per_job``
EVALUATION_TASKS = ("validate", "test", "infer", "route", "own_model", "cross_site")
#: hosts whose tracking server is the server's own machine
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
#: a training job's state folder records its submitter here (``record_origin``)
ORIGIN = "origin.json"
#: FLARE's study of a job submitted outside any study (``nvflare.apis.job_def.DEFAULT_STUDY``): it joins no one
DEFAULT_STUDY = "default"


class PolicyError(ValueError):
    """The site's policy refuses what the job asks; names the site, the settings file, the key and the fix."""


def deployed(job_id: str | None) -> bool:
    """Whether a site runs in a POC or provisioned deployment (a FLARE job id other than the simulator's)."""
    return job_id is not None and job_id != SIMULATOR_JOB_ID


def _kind_ok(kind: str, value) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "optional bool":
        return value is None or isinstance(value, bool)
    if kind == "count":
        return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
    if kind in ("number", "optional number"):
        if value is None:
            return kind == "optional number"
        return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")
    return value is None or (isinstance(value, list) and all(isinstance(m, str) for m in value))


WANT = {"bool": "true or false", "optional bool": "true, false or null", "methods": "null or a list of method names",
        "count": "null or an integer >= 1", "number": "a number >= 0", "optional number": "null or a number >= 0"}


def check_policy(policy, source: str, site: str = "this site", registered: Collection[str] | None = None) -> dict:
    """The effective policy: ``policy`` (the settings' ``policy`` object, may be None) over the defaults.

    Args:
        registered: the registered method names (``pflseg.flare.methods.METHODS``), from a caller that has the
            registry (the site's entry point ``pflseg.flare.client.answer``, ``pflseg site init`` and ``site
            check``): ``policy.methods`` may name only these. None: not checked here (this module sits below the
            registry; a job whose method the policy does not list is refused by ``check_task`` all the same).

    Raises:
        PolicyError: an unknown key, a value of the wrong kind or (with ``registered``) an unknown method, naming the
            file and the key.
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
        if not _kind_ok(kind, value):
            raise PolicyError(f"site {site}: policy.{key} in {source} must be {WANT[kind]}, got {value!r}")
        out[key] = value
    if out["methods"] is not None and registered is not None:
        wrong = [m for m in out["methods"] if m not in registered]
        if wrong:
            raise PolicyError(f"site {site}: policy.methods in {source} names unknown method(s) {wrong}; "
                              f"known: {', '.join(registered)}")
    return out


def effective(policy: dict, key: str, job_id: str | None):
    """``policy[key]``, a null resolved by ``UNSET`` for where the site runs (simulator or deployment)."""
    value = policy[key]
    if value is None and key in UNSET:
        value = UNSET[key][deployed(job_id)]
    return value


def _refuse(site: str, settings: dict, key: str, what: str, fix: str, job_id: str | None = None) -> PolicyError:
    value = settings["policy"][key]
    shown = _shown(value, POLICY[key][1])
    if value is None and key in UNSET:
        shown = f"null ({_shown(effective(settings['policy'], key, job_id))} in a " + (
            "deployment)" if deployed(job_id) else "simulator)")
    return PolicyError(f"site {site}: the site's policy refuses {what} (policy.{key}: {shown}, from "
                       f"{settings.get('policy_source', settings['source'])}); {fix}")


def check_task(site: str, task: str, cfg: dict, sites: list[str], settings: dict, job_id: str | None, entry) -> None:
    """Refuse what the site's policy does not allow in job ``cfg`` (the server's config) with ``sites``, before
    the site is made and before every task (``pflseg.flare.client.answer``). A scoring task that passes counts
    towards ``max_evaluations_per_job``; a deployed training job's state folder gets its ``ORIGIN`` once the site has
    claimed it (``record_origin``); a deployed ``own_model`` task reads the trained job's folder only when its origin
    matches (``check_bundle_origin``).

    Args:
        entry: the registry entry of the job's method (``pflseg.flare.methods.method(cfg)``), from the caller: this
            module sits below the registry.

    Raises:
        PolicyError: names the site, the setting (key and file) and what the job or the site can change.
    """
    policy, method, on_prod = settings["policy"], cfg["method"], deployed(job_id)
    if policy["methods"] is not None and method not in policy["methods"]:
        raise _refuse(site, settings, "methods", f"method '{method}' (job {cfg['name']})",
                      "submit a job of an allowed method, or add it at the site (`pflseg site init --methods ...`)")
    privacy = cfg["privacy"]
    if privacy["per_case"] and not effective(policy, "per_case", job_id):
        raise _refuse(site, settings, "per_case", "Dice per case (the job asks privacy.per_case: true)",
                      "run the job with privacy.per_case: false, or allow it at the site (`pflseg site init "
                      "--allow-per-case`)", job_id)
    if privacy["round_test"] and not policy["round_test"]:
        raise _refuse(site, settings, "round_test", "per-round test scores (the job asks privacy.round_test: true)",
                      "run the job with privacy.round_test: false")
    sent = entry.site.personal_models_sent(cfg)
    if sent and not policy["publish"]:
        raise _refuse(site, settings, "publish", f"sending {sent}", "run the job with the setting that keeps it at "
                      "the site (e.g. iopfl.publish: false, lcfed.hc: false), or a method that does (e.g. fedbn)")
    training = entry.after is None  # post-training jobs read a published bundle
    exchanges = entry.site.exchanges_models and training
    if on_prod and len(sites) == 2 and exchanges and not policy["two_sites"]:
        raise _refuse(site, settings, "two_sites", f"a {method} job of exactly two sites ({', '.join(sites)}): "
                      "what a site receives gives it the other site's model (docs/privacy.md: two sites are one too "
                      "few)",
                      "run the job with three or more sites, or allow it at the site (`pflseg site init "
                      "--allow-two-sites`)")
    if exchanges:
        check_dp(site, cfg, settings)
    check_sizes(site, cfg, settings, job_id, training)
    target = remote_tracking_target(cfg["tracking"])
    if target and not effective(policy, "remote_tracking", job_id):
        raise _refuse(site, settings, "remote_tracking", f"sending the site's metrics to {target}",
                      "run the job with tracking.mlflow_uri null (the server's own file store) or on the server's "
                      "host, and tracking.wandb_mode: offline; or allow it at the site (`pflseg site init "
                      "--allow-remote-tracking`)", job_id)
    if task == "submit_model":
        check_publish(site, cfg, settings)
    if settings["data"] is None and on_prod and not cfg["data"].get("allow_synthetic"):
        where = settings.get("policy_source", settings["source"])
        raise PolicyError(f"site {site}: no data configured at this site ({where}), and the job does not "
                          "opt in to synthetic data (data.allow_synthetic); configure the site's data with `pflseg "
                          "site "
                          "init --data DIR`, or, for a test federation, run the job with data.allow_synthetic: true")
    if on_prod:
        state_root = _state_root(site, settings)
        if training:
            record_origin(state_root / cfg["name"], job_id, only_if_claimed=True)
        elif task == "own_model" and cfg["cross_site"]["bundle"]:
            trained = Path(cfg["cross_site"]["bundle"]).name
            check_bundle_origin(f"site {site}", state_root / trained, job_id, "cross_site.bundle")
    if task in EVALUATION_TASKS:
        count_evaluation(site, settings, job_id)


def check_dp(site: str, cfg: dict, settings: dict) -> None:
    """A site that requires DP (``require_dp``, or ``min_noise_multiplier`` > 0) refuses a training job whose model
    updates leave without it, or with less noise than its minimum."""
    policy, dp = settings["policy"], cfg["privacy"]["update"]["dp"]
    least = policy["min_noise_multiplier"]
    if not (policy["require_dp"] or least > 0):
        return
    if dp["clip"] is None or dp["noise_multiplier"] <= 0:
        key = "require_dp" if policy["require_dp"] else "min_noise_multiplier"
        raise _refuse(site, settings, key, f"model updates without DP (the job has privacy.update.dp.clip: "
                      f"{_shown(dp['clip'])}, noise_multiplier: {dp['noise_multiplier']})",
                      f"run the job with privacy.update.dp.clip set and privacy.update.dp.noise_multiplier >= "
                      f"{max(least, 0.0) or 'a value > 0'}")
    if dp["noise_multiplier"] < least:
        raise _refuse(site, settings, "min_noise_multiplier", f"DP noise_multiplier {dp['noise_multiplier']} (the "
                      f"job's privacy.update.dp.noise_multiplier)",
                      f"run the job with privacy.update.dp.noise_multiplier >= {least}")


def check_sizes(site: str, cfg: dict, settings: dict, job_id: str | None, training: bool = True) -> None:
    """``min_batch_size`` (training jobs), ``max_image_size``, ``max_rounds_x_epochs`` and ``max_memory_gib``
    (``pflseg.config.check_memory`` with the slices of the site's data) for where the site runs."""
    from pflseg.config import ConfigError, check_memory, machine_memory

    policy = settings["policy"]
    least = effective(policy, "min_batch_size", job_id)
    if training and least is not None and cfg["train"]["batch_size"] < least:
        raise _refuse(site, settings, "min_batch_size", f"train.batch_size {cfg['train']['batch_size']} (one update "
                      "from few images says more about each)", f"run the job with train.batch_size >= {least}", job_id)
    most = effective(policy, "max_image_size", job_id)
    if most is not None and cfg["data"]["size"] > most:
        raise _refuse(site, settings, "max_image_size", f"data.size {cfg['data']['size']}",
                      f"run the job with data.size <= {most}", job_id)
    most = effective(policy, "max_rounds_x_epochs", job_id)
    work = cfg["rounds"] * cfg["train"]["epochs"]
    if most is not None and work > most:
        raise _refuse(site, settings, "max_rounds_x_epochs", f"rounds x train.epochs = {cfg['rounds']} x "
                      f"{cfg['train']['epochs']} = {work}", f"run the job with rounds x train.epochs <= {most}",
                      job_id)
    budget = effective(policy, "max_memory_gib", job_id)
    if budget is None:
        return
    host, gpu = machine_memory(str(settings.get("device") or "auto"))
    if budget != "machine":  # the site's own bound, for its host and its GPU alike
        host, gpu = int(budget * 2**30), None if gpu is None else int(budget * 2**30)
    try:
        check_memory(cfg, f"job {cfg['name']}", site_slices(settings, site), host, gpu)
    except ConfigError as exc:
        raise _refuse(site, settings, "max_memory_gib", f"what the job needs: {exc}",
                      "lower the keys named, or let the site allow more (policy.max_memory_gib)", job_id) from exc


def site_slices(settings: dict, site: str) -> int:
    """The number of 2D slices of the site's configured data, every split (what its slice cache may hold): from the
    datalist and the NIfTI headers only; 0 when no data is configured or it cannot be read (the site's own data
    check names that problem when the site is made)."""
    if settings["data"] is None:
        return 0
    from pflseg.data.datalist import read_datalist, resolve
    from pflseg.data.files import is_nifti

    try:
        root = Path(settings["data"]).expanduser()
        data_site = settings.get("data_site") or site
        total = 0
        for entries in read_datalist(root, data_site).values():
            for entry in entries if isinstance(entries, list) else []:
                path = resolve(root / data_site, entry["image"])
                total += _depth(path) if is_nifti(path) else 1
        return total
    except Exception:  # noqa: BLE001 - a data problem is the data check's to name, with its file
        return 0


def _depth(path: Path) -> int:
    import nibabel as nib

    shape = nib.load(str(path)).shape  # the header only
    return int(shape[2]) if len(shape) >= 3 else 1


def remote_tracking_target(tracking: dict) -> str | None:
    """Where the job's tracking sends metrics off the server's machine, in words; None when it does not (no
    receiver, a file store, an MLflow server on the server's own host, W&B offline)."""
    receivers = tracking.get("receivers") or []
    uri = tracking.get("mlflow_uri")
    if "mlflow" in receivers and uri:
        parts = urlsplit(uri.strip())
        hosted = uri.strip().startswith("databricks")  # MLflow's "databricks" / "databricks://profile": a service
        local = (parts.scheme in ("", "file", "sqlite") and not parts.netloc and not hosted
                 or (parts.hostname or "") in LOCAL_HOSTS)
        if not local:
            return f"MLflow at {parts.hostname or parts.netloc or uri.strip()} (tracking.mlflow_uri)"
    if "wandb" in receivers and tracking.get("wandb_mode") == "online":
        return "Weights & Biases online (tracking.wandb_mode: online)"
    return None


def count_evaluation(site: str, settings: dict, job_id: str | None) -> int:
    """Count one more scoring task of FLARE job ``job_id`` (``<state root>/evaluations/<job id>``, 0600) and refuse
    it beyond ``max_evaluations_per_job``; returns the count. Nothing is counted where there is no bound."""
    most = effective(settings["policy"], "max_evaluations_per_job", job_id)
    if most is None:
        return 0
    from pflseg.flare.state import private_dir, write_text

    folder = private_dir(_state_root(site, settings) / "evaluations")
    path = folder / _file_name(job_id or "none")
    try:
        count = int(path.read_text().strip() or 0) if path.is_file() else 0
    except (OSError, ValueError):
        count = most  # an unreadable count is spent
    if count >= most:
        raise _refuse(site, settings, "max_evaluations_per_job", f"scoring task {count + 1} of FLARE job {job_id} "
                      "(each scoring of a new model on the same cases says more about them)",
                      "submit a new job for another evaluation, or let the site allow more "
                      "(policy.max_evaluations_per_job)", job_id)
    write_text(path, f"{count + 1}\n")
    return count + 1


def _file_name(job_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in job_id) or "_"


def _state_root(site: str, settings: dict) -> Path:
    """The site's state root (``pflseg.flare.state.state_dir``'s rule)."""
    from pflseg.flare.state import state_dir

    return state_dir(site, "_", settings.get("state_dir")).parent


def job_origin(job_id: str | None, meta: dict | None = None) -> dict:
    """Who submitted FLARE job ``job_id`` and in which study: ``{"submitter", "org", "study"}`` from its job meta
    (``meta``, else the ``meta.json`` FLARE writes into the job's run folder, ``./<job id>/``, where a site's and the
    server's job process run); ``{}`` when there is none (the simulator, a test)."""
    if meta is None and deployed(job_id):
        try:
            meta = json.loads((Path.cwd() / _file_name(job_id) / "meta.json").read_text())
        except (OSError, ValueError):
            meta = None
    if not isinstance(meta, dict) or not meta.get("submitter_name"):
        return {}
    return {"submitter": str(meta["submitter_name"]), "org": str(meta.get("submitter_org") or ""),
            "study": str(meta.get("study") or DEFAULT_STUDY)}


def record_origin(folder: str | Path, job_id: str | None, meta: dict | None = None,
                  only_if_claimed: bool = False) -> bool:
    """Write ``<folder>/origin.json`` (0600): job ``job_id``'s submitter and study (``job_origin``), once, in a
    training job's state folder. ``only_if_claimed``: only when the folder is this job's already (``owner.json``:
    the state of an earlier job of the name is moved aside first). Returns whether it wrote it."""
    from pflseg.flare.state import owner, write_text

    folder = Path(folder)
    origin = job_origin(job_id, meta)
    if not origin or (folder / ORIGIN).is_file() or not folder.is_dir():
        return False
    if only_if_claimed and owner(folder) != job_id:
        return False
    write_text(folder / ORIGIN, json.dumps({"job_id": job_id, **origin}) + "\n")
    return True


def check_bundle_origin(who: str, folder: str | Path, job_id: str | None, key: str, meta: dict | None = None) -> None:
    """A deployed post-training job (``job_id``) reads the trained job's state ``folder`` (named by config ``key``)
    only when the same person submitted both, or both belong to the same FLARE study (not the default one).

    Raises:
        PolicyError: names ``who`` refuses, the key, both submitters and the fix.
    """
    if not deployed(job_id):
        return
    mine = job_origin(job_id, meta)
    try:
        theirs = json.loads((Path(folder) / ORIGIN).read_text())
    except (OSError, ValueError):
        theirs = {}
    fix = "train it again under your own name (or in a shared FLARE study), and name that job's state folder"
    if not theirs.get("submitter"):
        raise PolicyError(f"{who}: refusing {key}: the trained job's state folder {Path(folder).name} records no "
                          f"submitter ({ORIGIN}: a job of an older pflseg, or not trained under FLARE); {fix}")
    if not mine:
        raise PolicyError(f"{who}: refusing {key}: FLARE's job meta of job {job_id} names no submitter, so whose "
                          "bundle it may read cannot be told; submit the job through FLARE's admin API")
    same_study = mine["study"] == theirs.get("study") and mine["study"] != DEFAULT_STUDY
    if mine["submitter"] != theirs["submitter"] and not same_study:
        raise PolicyError(f"{who}: refusing {key}: the trained job {Path(folder).name} was submitted by "
                          f"{theirs['submitter']} (study {theirs.get('study', DEFAULT_STUDY)}), this job by "
                          f"{mine['submitter']} (study {mine['study']}): a bundle only from the submitter's own jobs "
                          f"or the same study; {fix}")


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
    if not effective(settings["policy"], "pooling", job_id):
        raise _refuse(site, settings, "pooling", f"training on other sites' folders {others} of its data root "
                      "(Centralized pools every site's data at one site)",
                      "run Centralized in the simulator only, or allow it at the site (`pflseg site init "
                      "--allow-pooling`)", job_id)


def synthetic_allowed(data_cfg: dict, job_id: str | None) -> bool:
    """Whether a site with no data configured may make the job's synthetic data set: in the simulator, or when the
    job opts in (``data.allow_synthetic``)."""
    return not deployed(job_id) or bool(data_cfg.get("allow_synthetic"))


def describe(policy: dict) -> list[str]:
    """One line per policy key: its value and what it allows (``pflseg site check``)."""
    lines = []
    for key, (default, kind, what) in POLICY.items():
        value = policy[key]
        note = "" if value == default else f" (default: {_shown(default, kind, key)})"
        lines.append(f"  {key}: {_shown(value, kind, key)}{note} -- {what}")
    return lines


def _shown(value, kind: str = "bool", key: str | None = None) -> str:
    if value is None:
        if key in UNSET:
            sim, prod = ("no bound" if v is None else _shown(v) for v in UNSET[key])
            return f"null (simulator: {sim}; deployment: {prod})"
        if kind == "optional bool":
            return "null (in the simulator only)"
        return "null (any)" if kind == "methods" else "null (no bound)"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "machine":
        return "this machine's memory"
    return ", ".join(value) if isinstance(value, list) else str(value)
