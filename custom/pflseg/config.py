"""Experiment configuration: ``app_configs/defaults.yaml`` is the schema, a job file overrides it.

Every key a job may set has a default in defaults.yaml; an unknown key or a value of the wrong type is an
error naming the key and the file. The merged result ("effective config") is what an exported job carries.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping
from pathlib import Path

import yaml

#: A job's name is a folder name (its state folder at the server and at every site): one plain name.
NAME_RULE = "^[A-Za-z0-9_-]+$"

#: Bounds of the values that size memory or run time at the server and the sites: a job's config comes from
#: whoever submits the job, and one absurd value must not exhaust a site. Dotted key -> (lowest, highest);
#: a list value (net.channels) is bounded entry by entry. The common keys only: a method's own keys are bounded by
#: its controller (``ranges``, checked by ``check_config`` with ``check_ranges``).
RANGES = {
    "rounds": (1, 10_000),
    "max_n_samples": (1, 1_000_000_000),
    "data.size": (1, 1024),
    "data.synth_sites": (1, 64),
    "net.channels": (1, 1024),
    "net.num_res_units": (0, 8),
    "net.embed_dim": (1, 1024),
    "net.n_sites": (0, 1024),
    "train.epochs": (1, 1000),
    "train.batch_size": (1, 1024),
    "train.eval_batch_size": (1, 1024),
}
MAX_NET_LEVELS = 8  # entries of net.channels / net.strides
#: Joint bounds of the segmentation network: its parameter count (counted on torch's meta device, nothing is
#: allocated; the default UNet has 0.2 M, LC-Fed's net 1.7 M) and an estimate of the feature maps one batch keeps
#: (``activation_bytes``). Each key alone is inside RANGES, but together they could ask for terabytes. These bounds
#: hold wherever a config is loaded; a deployed site also bounds the job by its own memory, the slice cache included
#: (``check_memory``, from ``pflseg.flare.policy.check_task``: policy ``max_memory_gib``).
MAX_NET_PARAMS = 200_000_000
MAX_ACTIVATION_GIB = 64.0
NORMS = ("batch", "instance")


class ConfigError(ValueError):
    """A configuration problem a person can fix: names the key, the file and the fix."""


def resource_dir(name: str) -> Path | None:
    """A folder that ships with pflseg (``app_configs``, ``provisioning``): the checkout's top-level ``<name>/``
    beside ``custom/`` (their one source), else an installed wheel's copy ``pflseg/_data/<name>/`` (made by
    setup.py's build step, read with importlib.resources); None when neither is there."""
    checkout = Path(__file__).resolve().parents[2] / name
    if checkout.is_dir():
        return checkout
    from importlib.resources import files

    packaged = files("pflseg").joinpath("_data", name)
    return Path(str(packaged)) if packaged.is_dir() else None


def configs_dir() -> Path:
    """The app_configs folder: $PFLSEG_CONFIGS, else the checkout's, else the installed package's
    (``resource_dir``)."""
    env = os.environ.get("PFLSEG_CONFIGS")
    path = Path(env) if env else resource_dir("app_configs")
    if path is None or not (path / "defaults.yaml").is_file():
        where = path or "this checkout or the installed pflseg (pflseg/_data/app_configs)"
        raise ConfigError(f"no defaults.yaml in {where}: set PFLSEG_CONFIGS to the app_configs folder of pflseg, or "
                          "reinstall pflseg from its wheel")
    return path


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read YAML ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def merge(base: Mapping, override: Mapping, source: str = "override", prefix: str = "") -> dict:
    """Return ``base`` updated by ``override``; unknown keys and wrong types raise ConfigError."""
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        dotted = f"{prefix}{key}"
        if key not in base:
            known = ", ".join(f"{prefix}{k}" for k in base)
            raise ConfigError(f"{source}: unknown key '{dotted}'. Known keys here: {known}")
        default = base[key]
        if isinstance(default, Mapping):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{source}: '{dotted}' must be a mapping, got {value!r}")
            out[key] = merge(default, value, source, f"{dotted}.")
        else:
            out[key] = _coerce(default, value, dotted, source)
    return out


#: ``train.amp``: mixed precision of the sites' forward passes (``pflseg.train.loop.amp_dtype``)
AMP_MODES = ("off", "bf16", "fp16")
#: string keys whose value "off" YAML reads as false when unquoted (``amp: off``, ``--set train.amp=off``): false
#: is taken as "off"; true is left for ``validate`` to refuse by name
OFF_STRINGS = {"train.amp"}


def _coerce(default, value, dotted: str, source: str):
    if dotted in OFF_STRINGS and isinstance(value, bool):
        return value or "off"
    if default is None or value is None:
        return value
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(default, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif isinstance(default, int) and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif isinstance(default, str) and isinstance(value, str):
        return value
    elif isinstance(default, list) and isinstance(value, list):
        return value
    raise ConfigError(
        f"{source}: '{dotted}' must be {type(default).__name__} like the default {default!r}, got {value!r}"
    )


def check_name(name, source: str = "config") -> str:
    """``name`` if it is a plain job name (``NAME_RULE``); else ConfigError naming the value and the rule.

    The name becomes the job's state folder at the server and every site (``pflseg.flare.state.state_dir``),
    so an absolute path or ``..`` would let a job's submitter write or delete files outside the state root.
    """
    if not isinstance(name, str) or not re.fullmatch(NAME_RULE, name):
        raise ConfigError(f"{source}: name={name!r} is not a job name: it must match {NAME_RULE} (letters, digits, "
                          "'_' and '-' only; it names the job's state folder)")
    return name


def check_ranges(cfg: Mapping, source: str = "config", ranges: Mapping | None = None,
                 table: str = "pflseg.config.RANGES") -> None:
    """Every key of ``ranges`` (``RANGES`` when None; a method's own: its controller's ``ranges``) inside its bounds
    (ConfigError naming the key, the value, the bound and ``table``, where the bound is set)."""
    for dotted, (low, high) in (RANGES if ranges is None else ranges).items():
        node = cfg
        for part in dotted.split("."):
            if not isinstance(node, Mapping) or part not in node:
                raise ConfigError(f"{source}: no '{dotted}' (a job exported by an older pflseg?): export the job again")
            node = node[part]
        for value in node if isinstance(node, list) else [node]:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{source}: {dotted}={node!r} must be an integer (entries of a list too)")
            if value > high:
                raise ConfigError(f"{source}: {dotted}={node!r} exceeds the cap {high} (values that size memory or "
                                  f"run time are bounded, see {table})")
            if value < low:
                raise ConfigError(f"{source}: {dotted}={node!r} must be >= {low}")


def activation_bytes(cfg: Mapping, batch: int, training: bool = True) -> float:
    """Estimated bytes of the feature maps one batch of ``batch`` images keeps in the network: per level i
    ``size^2 / (s_1 ... s_i)^2 x channels[i]`` float32 values, about 6 tensors each (convolution, normalisation,
    activation, in the encoder and the decoder) per residual unit plus one, doubled for the gradients when
    ``training``. An order of magnitude, used to bound the config jointly, not a measurement."""
    net, side = cfg["net"], cfg["data"]["size"]
    values, scale = 0.0, 1
    for level, channels in enumerate(net["channels"]):
        if level:
            scale *= net["strides"][level - 1] if level - 1 < len(net["strides"]) else 1
        values += (side / max(scale, 1)) ** 2 * channels
    return batch * values * 4 * 6 * (1 + net["num_res_units"]) * (2 if training else 1)


def check_net_budget(cfg: Mapping, source: str = "config") -> None:
    """The network's parameter count (built on torch's meta device) and its activation estimate within
    ``MAX_NET_PARAMS`` / ``MAX_ACTIVATION_GIB``: ConfigError naming the keys that size them and the numbers."""
    import torch

    from pflseg.nets import NETS, build_net, fit_to_sites

    net = cfg["net"]
    if net["name"] not in NETS:
        raise ConfigError(f"{source}: net.name must be one of {', '.join(NETS)}, got {net['name']!r}")
    if net["norm"] not in NORMS:
        raise ConfigError(f"{source}: net.norm must be one of {', '.join(NORMS)}, got {net['norm']!r}")
    if isinstance(net["dropout"], bool) or not 0.0 <= net["dropout"] < 1.0:
        raise ConfigError(f"{source}: net.dropout must lie in [0, 1), got {net['dropout']!r}")
    if len(net["strides"]) != len(net["channels"]) - 1 or any(s < 1 for s in net["strides"]):
        raise ConfigError(f"{source}: net.strides needs len(net.channels) - 1 = {len(net['channels']) - 1} entries "
                          f">= 1, got {net['strides']!r}")
    for key, batch, training in (("train.batch_size", cfg["train"]["batch_size"], True),
                                 ("train.eval_batch_size", cfg["train"]["eval_batch_size"], False)):
        gib = activation_bytes(cfg, batch, training) / 2**30
        if gib > MAX_ACTIVATION_GIB:
            raise ConfigError(f"{source}: data.size={cfg['data']['size']} x {key}={batch} x net.channels="
                              f"{net['channels']} (net.strides={net['strides']}, net.num_res_units="
                              f"{net['num_res_units']}) needs about {gib:.0f} GiB of feature maps per batch, over the "
                              f"budget of {MAX_ACTIVATION_GIB:.0f} GiB (pflseg.config.MAX_ACTIVATION_GIB): lower one "
                              "of these keys")
    sized = dict(net)
    try:
        fit_to_sites(sized, ["one site"])  # a net sized by its sites (n_sites: 0 until they join) counted at one
        with torch.device("meta"):
            n_params = sum(p.numel() for p in build_net(sized).parameters())
    except (ValueError, TypeError, AssertionError) as exc:
        raise ConfigError(f"{source}: net: {exc}") from exc
    if n_params > MAX_NET_PARAMS:
        raise ConfigError(f"{source}: the network of net.channels={net['channels']}, net.num_res_units="
                          f"{net['num_res_units']}, net.in_channels={net['in_channels']}, net.out_channels="
                          f"{net['out_channels']} has {n_params / 1e6:,.0f} M parameters, over the budget of "
                          f"{MAX_NET_PARAMS / 1e6:,.0f} M (pflseg.config.MAX_NET_PARAMS): use fewer or narrower "
                          "levels (net.channels) or fewer residual units (net.num_res_units)")


def cache_bytes(cfg: Mapping, n_slices: int) -> float:
    """Bytes of a site's slice cache (``pflseg.data.datasets.SliceDataset``, cache on): per 2D slice its image, its
    intensity copy (``net.in_channels`` each) and its label (``net.out_channels``), ``data.size``^2 float32 values."""
    net, side = cfg["net"], cfg["data"]["size"]
    return n_slices * (2 * net["in_channels"] + net["out_channels"]) * side * side * 4.0


def machine_memory(device: str = "auto") -> tuple[int, int | None]:
    """``(host bytes, GPU bytes or None)`` of this machine: its physical memory (psutil, else ``os.sysconf``), and
    the total memory of the CUDA device a site of setting ``device`` (auto | cpu | cuda | cuda:N) computes on."""
    try:
        import psutil

        host = int(psutil.virtual_memory().total)
    except ImportError:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpu = None
    if device != "cpu":
        import torch

        if torch.cuda.is_available():
            index = int(device[5:]) if device.startswith("cuda:") and device[5:].isdigit() else 0
            if index < torch.cuda.device_count():
                gpu = int(torch.cuda.get_device_properties(index).total_memory)
    return host, gpu


def check_memory(cfg: Mapping, source: str, n_slices: int, host_bytes: float, gpu_bytes: float | None = None) -> None:
    """The job's memory at a site within what the site has: the feature maps of one training (or evaluation) batch
    (``activation_bytes``) on the GPU when ``gpu_bytes`` is given, else in ``host_bytes`` together with the slice cache
    of ``n_slices`` slices (``cache_bytes``). ConfigError naming the keys that size each and the numbers."""
    train = activation_bytes(cfg, cfg["train"]["batch_size"], True)
    evaluate = activation_bytes(cfg, cfg["train"]["eval_batch_size"], False)
    maps, key = (train, "train.batch_size") if train >= evaluate else (evaluate, "train.eval_batch_size")
    cache = cache_bytes(cfg, n_slices)
    gib = 2.0**30
    if gpu_bytes is not None and maps > gpu_bytes:
        raise ConfigError(f"{source}: data.size={cfg['data']['size']} x {key}={cfg['train'][key.split('.')[1]]} "
                          f"needs about {maps / gib:.1f} GiB of feature maps per batch, over the site's GPU memory "
                          f"({gpu_bytes / gib:.1f} GiB): lower data.size or {key}")
    host = cache + (0.0 if gpu_bytes is not None else maps)
    if host > host_bytes:
        parts = [f"the slice cache of {n_slices} slices at data.size={cfg['data']['size']}: {cache / gib:.1f} GiB"]
        if gpu_bytes is None:
            parts.insert(0, f"feature maps of data.size={cfg['data']['size']} x {key}="
                            f"{cfg['train'][key.split('.')[1]]}: {maps / gib:.1f} GiB")
        raise ConfigError(f"{source}: needs about {host / gib:.1f} GiB at the site ({'; '.join(parts)}), over its "
                          f"memory ({host_bytes / gib:.1f} GiB): lower data.size or {key}")


def value_at(cfg: Mapping, dotted: str):
    """``cfg``'s value of a dotted key (``"fedsm.lam"``)."""
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def check_lr(cfg: Mapping, dotted: str, source: str = "config") -> None:
    """The value of ``dotted`` (``train.lr``, a method's own rate) a learning rate in (0, 10]."""
    value = value_at(cfg, dotted)
    if isinstance(value, bool) or not 0.0 < value <= 10.0:  # also NaN
        raise ConfigError(f"{source}: {dotted} must be a learning rate in (0, 10], got {value!r}")


def check_choice(cfg: Mapping, dotted: str, allowed, source: str = "config") -> None:
    """The value of ``dotted`` one of ``allowed`` (None written as null)."""
    value = value_at(cfg, dotted)
    if value not in allowed:
        names = ", ".join("null" if a is None else str(a) for a in allowed)
        raise ConfigError(f"{source}: {dotted} must be one of {names}, got {value!r}")


def validate(cfg: Mapping, source: str = "config") -> None:
    """Check the common keys' values that types alone cannot (ranges, choices). The method name and the method's own
    sections (ranges and rules: its controller's ``check_config``) are checked by the registry,
    ``pflseg.flare.methods.method``, wherever a job is built, run or received: this layer knows no method."""
    check_ranges(cfg, source)
    net = cfg["net"]
    if len(net["channels"]) > MAX_NET_LEVELS or len(net["strides"]) > MAX_NET_LEVELS:
        raise ConfigError(f"{source}: net.channels / net.strides have {len(net['channels'])} / {len(net['strides'])} "
                          f"entries, which exceeds the cap {MAX_NET_LEVELS}")
    if cfg["min_clients"] < 1:
        raise ConfigError(f"{source}: min_clients must be >= 1, got {cfg['min_clients']}")
    if cfg["data"]["synth_task"] not in ("prostate", "fundus"):
        raise ConfigError(f"{source}: data.synth_task must be prostate or fundus, got {cfg['data']['synth_task']!r}")
    if cfg["train"]["loss"] not in ("dice", "dice_ce"):
        raise ConfigError(f"{source}: train.loss must be dice or dice_ce, got {cfg['train']['loss']!r}")
    if cfg["train"]["amp"] not in AMP_MODES:
        raise ConfigError(f"{source}: train.amp must be one of {', '.join(AMP_MODES)} (YAML reads a bare on / yes as "
                          f"true: write bf16 or fp16), got {cfg['train']['amp']!r}")
    check_lr(cfg, "train.lr", source)
    check_net_budget(cfg, source)
    robust = cfg["robust"]
    if robust["aggregation"] not in ("mean", "median", "trimmed_mean"):
        raise ConfigError(f"{source}: robust.aggregation must be one of mean, median, trimmed_mean, got "
                          f"{robust['aggregation']!r}")
    if not 0.0 <= robust["trim"] < 0.5:
        raise ConfigError(f"{source}: robust.trim must lie in [0, 0.5) (the fraction dropped at each end), got "
                          f"{robust['trim']}")
    if isinstance(robust["median_rounds"], bool) or not (isinstance(robust["median_rounds"], int)
                                                         and robust["median_rounds"] >= 0):
        raise ConfigError(f"{source}: robust.median_rounds must be an integer >= 0 (the first rounds aggregated by the "
                          f"median; 0 = none), got {robust['median_rounds']!r}")
    for key in ("n_k_ratio", "norm_ratio", "clip"):
        if not (robust[key] == 0 or 1.0 <= robust[key] <= 1e12):
            raise ConfigError(f"{source}: robust.{key} must be 0 (no bound) or in [1, 1e12] (a multiple of the other "
                              f"sites' median; an honest site may be that many times the others), got {robust[key]}")
    check_update_privacy(cfg["privacy"]["update"], source)
    check_tracking(cfg["tracking"], source)
    if cfg["site"]["executor"] not in SITE_EXECUTORS:
        raise ConfigError(f"{source}: site.executor must be one of {', '.join(SITE_EXECUTORS)}, got "
                          f"{cfg['site']['executor']!r}")


#: ``site.executor``: what runs a site's tasks (``pflseg.flare.jobs.site_executor``)
SITE_EXECUTORS = ("executor", "client_api")


#: ``privacy.update.filters`` entries: a FLARE filter class by its dotted path, under the key ``filter`` (FLARE's
#: config scanner takes any dict with a ``path``, ``class_path`` or ``name`` key inside the job config for a component)
FILTER_PATH = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$"


#: ``tracking.receivers``: name -> the module its FLARE receiver needs at the server, the pip command that brings it
TRACKERS = {"tensorboard": ("tensorboard", 'pip install tensorboard'),
            "mlflow": ("mlflow", 'pip install "pflseg[tracking]"  (or: pip install "mlflow>=2.10,<3")'),
            "wandb": ("wandb", 'pip install "pflseg[tracking]"  (or: pip install "wandb>=0.19,<1")')}
#: ``tracking.wandb_mode`` values (W&B's own modes; offline writes locally and never touches the network)
WANDB_MODES = ("offline", "online")


def check_tracking(tracking: Mapping, source: str = "config") -> None:
    """``tracking``: receivers a list of distinct TRACKERS names; mlflow_uri, experiment, wandb_dir null or a non-empty
    string; wandb_mode one of WANDB_MODES."""
    receivers = tracking["receivers"]
    if (not isinstance(receivers, list) or any(r not in TRACKERS for r in receivers)
            or len(set(receivers)) != len(receivers)):
        raise ConfigError(f"{source}: tracking.receivers must be a list of distinct names out of {', '.join(TRACKERS)} "
                          f"([] = none), got {receivers!r}")
    for key in ("mlflow_uri", "experiment", "wandb_dir"):
        value = tracking[key]
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"{source}: tracking.{key} must be null or a non-empty string, got {value!r}")
    if tracking["wandb_mode"] not in WANDB_MODES:
        raise ConfigError(f"{source}: tracking.wandb_mode must be one of {', '.join(WANDB_MODES)}, got "
                          f"{tracking['wandb_mode']!r}")


def check_trackers_installed(tracking: Mapping, source: str = "config") -> None:
    """Every receiver of ``tracking.receivers`` importable here (where the job is built and its server runs):
    ConfigError naming the key and the pip command otherwise, before FLARE starts."""
    import importlib.util

    for name in tracking["receivers"]:
        module, pip = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"{source}: tracking.receivers lists {name}, but the {module} package is not installed: "
                              f"{pip}, or take {name} out of tracking.receivers")


def check_update_privacy(update: Mapping, source: str = "config") -> None:
    """``privacy.update``: send weights | diff; dp.clip null or in (0, 1e12]; dp.noise_multiplier in [0, 1e6], > 0 only
    with a clip; filters a list of {filter, args} that needs send: diff."""
    if update["send"] not in ("weights", "diff"):
        raise ConfigError(f"{source}: privacy.update.send must be weights or diff, got {update['send']!r}")
    clip, sigma = update["dp"]["clip"], update["dp"]["noise_multiplier"]
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 < clip <= 1e12):
        raise ConfigError(f"{source}: privacy.update.dp.clip must be null (off) or a norm bound in (0, 1e12], got "
                          f"{clip!r}")
    if not 0.0 <= sigma <= 1e6:  # also NaN
        raise ConfigError(f"{source}: privacy.update.dp.noise_multiplier must lie in [0, 1e6], got {sigma!r}")
    if sigma > 0 and clip is None:
        raise ConfigError(f"{source}: privacy.update.dp.noise_multiplier={sigma} needs privacy.update.dp.clip (the "
                          "noise's "
                          "standard deviation is noise_multiplier x clip)")
    filters = update["filters"]
    for entry in filters:
        if (not isinstance(entry, Mapping) or set(entry) - {"filter", "args"}
            or not isinstance(entry.get("filter"), str)
                or not re.fullmatch(FILTER_PATH, entry["filter"]) or not isinstance(entry.get("args", {}), Mapping)):
            raise ConfigError(f"{source}: privacy.update.filters entry {entry!r} must be "
                              f"{{filter: <dotted class path>, "
                              "args: {...}}, e.g. {filter: nvflare.app_common.filters.ExcludeVars, args: "
                              "{exclude_vars: "
                              "['global.model.0.conv.unit0.conv.weight']}}")
    if filters and update["send"] != "diff":
        raise ConfigError(f"{source}: privacy.update.filters need privacy.update.send: diff (FLARE's filters work on "
                          "weight differences; on full weights they clip or drop the model itself)")


def defaults(config_dir: Path | None = None) -> dict:
    return _read_yaml((config_dir or configs_dir()) / "defaults.yaml")


def load_job_config(name: str, config_dir: Path | None = None, overrides: Mapping | None = None) -> dict:
    """Effective config of job ``name``: defaults <- app_configs/<name>.yaml <- ``overrides``."""
    check_name(name, "job")
    config_dir = config_dir or configs_dir()
    path = config_dir / f"{name}.yaml"
    if not path.is_file():
        jobs = ", ".join(job_names(config_dir))
        raise ConfigError(f"no job config {path}; jobs: {jobs}")
    cfg = merge(defaults(config_dir), _read_yaml(path), str(path))
    source = str(path)
    if overrides:
        own = cfg
        cfg = merge(cfg, overrides, "command-line overrides")
        try:
            validate(cfg, source)
        except ConfigError:
            validate(own, source)  # the file's own value is wrong: named as the file's
            source = f"command-line overrides ({', '.join(_dotted(overrides))}) of {path}"
            validate(cfg, source)  # else the override is: named as the override's
            raise
    else:
        validate(cfg, source)
    check_trackers_installed(cfg["tracking"], source)
    cfg["name"] = name
    return cfg


def _dotted(tree: Mapping, prefix: str = "") -> list[str]:
    """The dotted keys of a nested override dict: ``{"net": {"norm": "group"}}`` -> ``["net.norm"]``."""
    out = []
    for key, value in tree.items():
        out += _dotted(value, f"{prefix}{key}.") if isinstance(value, Mapping) and value else [f"{prefix}{key}"]
    return out


def check_effective(cfg: Mapping, source: str = "job config") -> dict:
    """Validate an already merged config (e.g. the one carried by an exported job) against the schema; the
    job's ``name`` (outside the schema) against ``NAME_RULE``."""
    name = check_name(cfg.get("name", "job"), source)
    body = {k: v for k, v in cfg.items() if k != "name"}
    try:
        schema = defaults()
    except ConfigError:  # pflseg installed without its app_configs (a site): the job was checked at export
        schema = body
    merged = merge(schema, body, source)
    validate(merged, source)
    merged["name"] = name
    return merged


def job_names(config_dir: Path | None = None) -> list[str]:
    config_dir = config_dir or configs_dir()
    return sorted(p.stem for p in config_dir.glob("*.yaml") if p.stem != "defaults")


def parse_set(items: list[str]) -> dict:
    """``["train.lr=1e-4", "rounds=3"]`` -> nested override dict (values parsed as YAML scalars)."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. train.lr=0.0005")
        key, raw = item.split("=", 1)
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(raw)
    return out
