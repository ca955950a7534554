"""Experiment configuration: ``app_configs/defaults.yaml`` is the schema, a job file overrides it.

Every key a job may set has a default in defaults.yaml; an unknown key or a value of the wrong type is an
error naming the key and the file. The merged result ("effective config") is what an exported job carries.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path

import yaml



class ConfigError(ValueError):
    """A configuration problem a person can fix: names the key, the file and the fix."""


def configs_dir() -> Path:
    """The app_configs folder: $PFLSEG_CONFIGS, else the one beside this checkout's custom/."""
    env = os.environ.get("PFLSEG_CONFIGS")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "app_configs"
    if not (path / "defaults.yaml").is_file():
        raise ConfigError(f"no defaults.yaml in {path}: set PFLSEG_CONFIGS to the app_configs folder of pflseg")
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


def _coerce(default, value, dotted: str, source: str):
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


def validate(cfg: Mapping, source: str = "config") -> None:
    """Check values that types alone cannot (ranges, choices). The method name and the method's own rules
    are checked against the registry, ``pflseg.flare.methods.method``, where a job is built or run."""
    if cfg["rounds"] < 1:
        raise ConfigError(f"{source}: rounds must be >= 1, got {cfg['rounds']}")
    if cfg["min_clients"] < 1:
        raise ConfigError(f"{source}: min_clients must be >= 1, got {cfg['min_clients']}")
    if cfg["data"]["synth_task"] not in ("prostate", "fundus"):
        raise ConfigError(f"{source}: data.synth_task must be prostate or fundus, got {cfg['data']['synth_task']!r}")
    if cfg["train"]["loss"] not in ("dice", "dice_ce"):
        raise ConfigError(f"{source}: train.loss must be dice or dice_ce, got {cfg['train']['loss']!r}")
    fedsm = cfg["fedsm"]
    if not 0.0 <= fedsm["lam"] <= 1.0 or not 0.0 <= fedsm["gamma"] <= 1.0:
        raise ConfigError(f"{source}: fedsm.lam and fedsm.gamma must lie in [0, 1], got {fedsm['lam']}, {fedsm['gamma']}")
    if fedsm["selector"] not in ("compact", "vgg11") or fedsm["selector_steps"] not in ("epoch", "batch"):
        raise ConfigError(f"{source}: fedsm.selector must be compact|vgg11 and fedsm.selector_steps epoch|batch")
    if fedsm["extra_rounds"] < 0 or any(not 0.0 <= g <= 1.0 for g in fedsm["gammas"]):
        raise ConfigError(f"{source}: fedsm.extra_rounds must be >= 0 and every fedsm.gammas value in [0, 1]")
    grace = cfg["grace"]
    choices = {"similarity": ("total", "split", "reweight"), "self_similarity": ("include", "exclude"),
               "align": ("coral", "mmd", "adv"), "inner_step": ("adam", "sgd")}
    for key, allowed in choices.items():
        if grace[key] not in allowed:
            raise ConfigError(f"{source}: grace.{key} must be one of {', '.join(allowed)}, got {grace[key]!r}")
    iopfl = cfg["iopfl"]
    choices = {"rule": ("ema", "paper_eq4"), "router": ("paper", "refcode", "model", "layer_global"),
               "loss_weights": ("paper", "refcode")}
    for key, allowed in choices.items():
        if iopfl[key] not in allowed:
            raise ConfigError(f"{source}: iopfl.{key} must be one of {', '.join(allowed)}, got {iopfl[key]!r}")
    if not 0.0 <= iopfl["tau"] <= 1.0 or iopfl["epochs"] < 1 or iopfl["shape_radius"] < 1 or iopfl["batch_size"] < 1:
        raise ConfigError(f"{source}: iopfl.tau must lie in [0, 1] and iopfl.epochs, shape_radius, batch_size be >= 1")
    lcfed = cfg["lcfed"]
    if lcfed["contrast_on"] not in ("gate", "gate_all", "embedding"):
        raise ConfigError(f"{source}: lcfed.contrast_on must be one of gate, gate_all, embedding, got {lcfed['contrast_on']!r}")
    if lcfed["lam"] < 0 or lcfed["head_first_iters"] < 0 or not 0.0 <= lcfed["nms_threshold"] < 1.0:
        raise ConfigError(f"{source}: lcfed.lam and lcfed.head_first_iters must be >= 0, lcfed.nms_threshold in [0, 1)")
    if any(lcfed[k] < 1 or lcfed[k] % 2 == 0 for k in ("nms_window", "gauss_size")) or lcfed["gauss_sigma"] < 0:
        raise ConfigError(f"{source}: lcfed.nms_window and lcfed.gauss_size must be odd >= 1, lcfed.gauss_sigma >= 0")
    if cfg["ft"]["epochs"] < 0:
        raise ConfigError(f"{source}: ft.epochs must be >= 0, got {cfg['ft']['epochs']}")
    if cfg["fedprox"]["mu"] < 0:
        raise ConfigError(f"{source}: fedprox.mu must be >= 0, got {cfg['fedprox']['mu']}")


def defaults(config_dir: Path | None = None) -> dict:
    return _read_yaml((config_dir or configs_dir()) / "defaults.yaml")


def load_job_config(name: str, config_dir: Path | None = None, overrides: Mapping | None = None) -> dict:
    """Effective config of job ``name``: defaults <- app_configs/<name>.yaml <- ``overrides``."""
    config_dir = config_dir or configs_dir()
    path = config_dir / f"{name}.yaml"
    if not path.is_file():
        jobs = ", ".join(job_names(config_dir))
        raise ConfigError(f"no job config {path}; jobs: {jobs}")
    cfg = merge(defaults(config_dir), _read_yaml(path), str(path))
    if overrides:
        cfg = merge(cfg, overrides, "command-line overrides")
    validate(cfg, str(path))
    cfg["name"] = name
    return cfg


def check_effective(cfg: Mapping, source: str = "job config") -> dict:
    """Validate an already merged config (e.g. the one carried by an exported job) against the schema."""
    body = {k: v for k, v in cfg.items() if k != "name"}
    try:
        schema = defaults()
    except ConfigError:  # pflseg installed without its app_configs (a site): the job was checked at export
        schema = body
    merged = merge(schema, body, source)
    validate(merged, source)
    merged["name"] = cfg.get("name", "job")
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
