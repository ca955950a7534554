"""`pflseg report gpu`: the GPU check, one command that fits about 10 minutes on one GPU.

    pflseg report gpu --workspace runs/gpu           # on a machine with CUDA
    pflseg report gpu --plan                         # what would run, and the estimate of its duration
    pflseg report gpu --dry-run --workspace /tmp/g   # everything on CPU at the smallest sizes (about 2 min)

Steps, in this order (a step whose estimate no longer fits ``--budget`` is skipped and named in the report):

1. **tests**: the gpu-marked tests (``python -m pytest -m gpu`` over the test files that mark any, as a
   subprocess of the repository's ``tests/``): passed / failed / skipped counts.
2. **sites**: FedAvg with 3 and 6 simulator sites sharing the one GPU (``SITES_SIZE`` px, a plain synthetic
   root, ``pflseg.eval.speed.data_root``; the demo's settings with ``SITES_EPOCHS`` local epochs); seconds per round
   and GPU memory per site.
3. **reference**: the 3-site FedAvg run again with every site on the CPU (``PFLSEG_DEVICE=cpu``, same seed and
   config): test Dice of the GPU run against the CPU run's (``DICE_TOL``).
4. **plain**: the plain PyTorch loop of ``pflseg.eval.speed`` (``plain_rounds``: its device is ``auto``, the
   GPU here) for the same 3-site FedAvg config: site compute / plain loop.
5. **amp**: one run per method of ``pflseg demo``'s inside table (the demo's data preset, settings and nets,
   ``ROUNDS`` rounds) with ``train.amp`` off and bf16: seconds per round, GPU memory per site, test Dice with bf16
   against without (``AMP_TOL``).

Seconds per round: the server's round wall (``history[r].wall_seconds``), median over rounds 1.. (round 0 also
loads the data; ``pflseg.eval.speed.round_costs``). GPU memory per site: torch's own peak inside a site process is
not reachable from here, so ``nvidia-smi --query-compute-apps=pid,used_memory`` is sampled every 0.5 s while a run
runs and each PID mapped to its site the way ``pflseg.deploy.sampling.named`` maps the simulator's processes (the
CUDA context included: what the GPU really holds for the site). Where the PIDs nvidia-smi reports are not the
processes' own (a container without the host's PID namespace), the per-site column is empty and the peak of the
whole GPU's used memory (``--query-gpu=memory.used``) is reported instead.

``--dry-run`` runs every step on the CPU at the smallest sizes (1 round, 2 sites, 16 px, one method, ``DRY_EXTRA``:
one epoch and a tiny U-Net; ``DRY_SPLIT`` cases per site of ``DRY_DEPTH`` slices): the gpu tests are collected and
skipped, the device is the CPU and the "GPU memory" column is the sites' host memory (PSS), each marked "dry run".
It exists so the test suite runs this command end to end and it cannot rot before a GPU is lent. Everything lands in
``<workspace>/gpu.json`` and ``<workspace>/gpu.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pflseg.deploy.sampling import GIB, MemorySampler, named
from pflseg.markdown import markdown_table
from pflseg.markdown import number_cell as _num

RESULTS_JSON, MARKDOWN = "gpu.json", "gpu.md"
#: |test Dice on the GPU - on the CPU| allowed, mean over sites, for the same seed and config (amp off). The GPU
#: computes convolutions in TF32 by default (cuDNN; a 10-bit mantissa) and in other summation orders, so the weights
#: drift apart from the first step. The same kind of drift from bf16 autocast (an 8-bit mantissa: larger) moved this
#: very protocol's mean test Dice by 0.004 (FedAvg 0.334 -> 0.330) and 0.001 (with AdaBN 0.155 -> 0.154) on the CPU
#: (3 sites, 32 px, 2 rounds of 8 epochs; no randomness is drawn on the device there). 0.02 is 5x that: it catches a
#: GPU path that trains differently (a wrong device, a dropped step, Dice near 0), not rounding.
DICE_TOL = 0.02
#: |test Dice with bf16 - without| allowed, mean over sites, per method (tests/gpu/test_cuda.py's DICE_TOL reasoning:
#: two to three rounds are early, chaotic training; a broken mixed-precision path shows as Dice near 0 or NaN)
AMP_TOL = 0.2
#: seconds the gpu-marked tests may take at most (the subprocess is stopped after)
TESTS_TIMEOUT_S = 240
#: rough seconds of one simulator run on an H100 for the plan's estimate, not yet measured on a GPU: FLARE's start-up,
#: each site's CUDA context and data, the final test (``START_S``), then ``ROUND_S`` per round; a CPU run of the
#: reference (16 cores) ``CPU_ROUND_S`` per round. gpu.json records the real seconds of every step to replace them.
START_S, ROUND_S, CPU_ROUND_S, TESTS_S, PLAIN_S = 25.0, 4.0, 12.0, 150.0, 20.0
#: the same for ``--dry-run`` on this project's 2-core CPU machine, which was shared with other work whenever it was
#: timed: at load 8, 5.2 min in all (tests 36 s, runs 41-54 s each, plain loop 57 s; 76 s of CPU time)
DRY_START_S, DRY_ROUND_S, DRY_TESTS_S, DRY_PLAIN_S = 25.0, 10.0, 30.0, 30.0
SITES_SIZE = 32
#: local epochs per round of the sites and reference runs: with the demo's settings and two rounds of 3 epochs the
#: 3-site FedAvg model is still near its start (test Dice 0.08 on the CPU), where any two runs agree; 8 epochs train it
SITES_EPOCHS = 8
#: the dry run's config on top: one epoch, no AdaBN control, a tiny U-Net (UNet jobs only); its one method is the
#: registry's (``Method.reports``: ``gpu-dry-run``)
DRY_EXTRA = {"train": {"epochs": 1, "adabn": False}, "net": {"channels": [4, 8, 16], "strides": [2, 2]}}
#: the dry run's data: cases per site for training / validation / test (one in each split at least) and slices per
#: case, for every step (the full check's: the default root's 10-12 cases of 12 slices, the demo preset's 13-19 of 8)
DRY_SPLIT, DRY_DEPTH = (3, 1, 1), 6


@dataclass(frozen=True)
class Plan:
    """What the check runs: ``methods`` x ``amp`` demo-preset runs, FedAvg at each of ``sites``, the CPU reference
    and the plain loop at the first of ``sites``."""

    dry_run: bool
    rounds: int
    methods: tuple[str, ...]
    sites: tuple[int, ...]
    size: int | None  # the methods' image size; None: the demo preset's
    amp: tuple[str, ...] = ("off", "bf16")
    sites_size: int = SITES_SIZE
    #: config overrides of the sites and reference runs (the full check: ``SITES_EPOCHS`` local epochs)
    sites_extra: dict = field(default_factory=dict)
    #: config overrides on top of the demo's settings (the dry run: one epoch)
    extra: dict = field(default_factory=dict)
    #: cases per site (training, validation, test) and slices per case of every step's data; None: the data's own
    split: tuple[int, int, int] | None = None
    depth: int | None = None


def demo_methods() -> tuple[str, ...]:
    """The training jobs of ``pflseg demo``'s inside table, in its order."""
    from pflseg.eval.demo import INSIDE

    return tuple(dict.fromkeys(row.job for row in INSIDE))


def make_plan(dry_run: bool = False) -> Plan:
    if dry_run:
        from pflseg.flare.methods import report_jobs

        return Plan(True, rounds=1, methods=report_jobs("gpu-dry-run"), sites=(2,), size=16, sites_size=16,
                    extra=DRY_EXTRA, split=DRY_SPLIT, depth=DRY_DEPTH)
    return Plan(False, rounds=2, methods=demo_methods(), sites=(3, 6), size=None,
                sites_extra={"train": {"epochs": SITES_EPOCHS}})


# ---- the steps and their estimate (pure) ----------------------------------------------------------------------------
def steps(plan: Plan) -> list[dict]:
    """Every step of ``plan`` in the order it runs: ``{"step", "what", "estimate_s", ...}``; the sites, reference and
    plain-loop steps run the registry's reference job."""
    from pflseg.flare.methods import REFERENCE_JOB

    start, per_round = (DRY_START_S, DRY_ROUND_S) if plan.dry_run else (START_S, ROUND_S)
    cpu_round = DRY_ROUND_S if plan.dry_run else CPU_ROUND_S
    device = "cpu (dry run)" if plan.dry_run else "cuda"
    out: list[dict] = [{"step": "tests", "what": "python -m pytest -m gpu (the files that mark gpu tests)",
                        "estimate_s": DRY_TESTS_S if plan.dry_run else TESTS_S}]
    for n in plan.sites:
        out.append({"step": "sites", "job": REFERENCE_JOB, "sites": n, "amp": "off", "device": device,
                    "size": plan.sites_size, "what": f"FedAvg, {n} sites sharing the device, {plan.sites_size} px",
                    "estimate_s": start + plan.rounds * per_round * max(1.0, n / 3)})
    first = plan.sites[0]
    out.append({"step": "reference", "job": REFERENCE_JOB, "sites": first, "amp": "off", "device": "cpu",
                "size": plan.sites_size, "what": f"FedAvg, {first} sites on the CPU (the Dice reference)",
                "estimate_s": start + plan.rounds * cpu_round})
    out.append({"step": "plain", "job": REFERENCE_JOB, "sites": first, "device": device,
                "what": f"plain PyTorch loop, {first} sites at once, {plan.rounds} round(s)",
                "estimate_s": DRY_PLAIN_S if plan.dry_run else PLAIN_S})
    for job in plan.methods:
        for amp in plan.amp:
            out.append({"step": "amp", "job": job, "sites": 3 if plan.size is None else first, "amp": amp,
                        "device": device, "size": plan.size,
                        "what": f"{job}, demo preset, train.amp {amp}",
                        "estimate_s": start + plan.rounds * per_round})
    return out


def plan_text(plan: Plan, budget: float | None) -> str:
    """What will run and the estimate of its duration (``--plan``; the first lines of every run)."""
    rows = steps(plan)
    total = sum(s["estimate_s"] for s in rows)
    kind = "dry run on the CPU" if plan.dry_run else "GPU check"
    lines = [f"pflseg report gpu: {kind}, {len(rows)} steps, {plan.rounds} round(s) per run; estimate "
             f"{total / 60:.1f} min" + (f" (budget {budget / 60:.1f} min: steps that no longer fit are skipped)"
                                        if budget else "")]
    lines += [f"  {i + 1:2d}. [{s['step']}] {s['what']} (~{s['estimate_s']:.0f} s)" for i, s in enumerate(rows)]
    if not plan.dry_run:
        lines.append("  (estimates for an H100 are guesses until the first GPU run; gpu.json records the real ones)")
    return "\n".join(lines)


# ---- parsing tool output (pure) -------------------------------------------------------------------------------------
def pytest_counts(text: str) -> dict[str, int]:
    """The counts of pytest's summary line (``3 passed, 1 failed, 2 skipped in 4.2s``): passed, failed, skipped,
    errors, deselected (0 when absent)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "deselected": 0}
    summary = [line for line in text.splitlines() if re.search(r"\b(passed|failed|skipped|errors?|deselected)\b"
                                                               r".* in [\d.]+s", line)]
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary[-1] if summary else ""):
        counts["errors" if word.startswith("error") else word] += int(number)
    return counts


def smi_apps(text: str) -> dict[int, float]:
    """``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`` -> {pid: MiB}."""
    out: dict[int, float] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit():
            try:
                out[int(parts[0])] = out.get(int(parts[0]), 0.0) + float(parts[1])
            except ValueError:  # "[N/A]" where the driver does not say
                continue
    return out


def per_site(apps: dict[int, float], labels: dict[int, str]) -> tuple[dict[str, float], float]:
    """GPU MiB per site (``labels``: pid -> site, as ``pflseg.deploy.sampling.named`` labels the simulator's
    processes) and the MiB of PIDs that are none of them."""
    sites: dict[str, float] = {}
    other = 0.0
    for pid, mib in apps.items():
        if pid in labels:
            sites[labels[pid]] = sites.get(labels[pid], 0.0) + mib
        else:
            other += mib
    return sites, other


# ---- GPU memory while a run runs ------------------------------------------------------------------------------------
def _smi(*query: str) -> str:
    return subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                          timeout=10, check=True).stdout


class GpuSampler(MemorySampler):
    """``MemorySampler`` whose memory is what nvidia-smi says each process holds on the GPU (parts: the sites of
    ``find``), and the whole GPU's used memory (``device_mib``). ``peak()`` adds ``peak_device_gib`` and
    ``unmatched_gib`` (processes none of ``find``'s: another run, or PIDs of another namespace)."""

    def __init__(self, find, period: float = 0.5, query: Callable[..., str] = _smi):
        super().__init__(find, period, pss=False)
        self.query, self.device_mib, self.unmatched_mib = query, 0.0, 0.0
        self.failures: list[str] = []

    def sample(self) -> None:
        try:
            apps = smi_apps(self.query("--query-compute-apps=pid,used_memory"))
            used = [float(v) for v in self.query("--query-gpu=memory.used").split() if v.replace(".", "").isdigit()]
        except (OSError, subprocess.SubprocessError) as exc:
            if not self.failures:
                self.failures.append(f"nvidia-smi: {type(exc).__name__}: {exc}")
            return
        sites, other = per_site(apps, {p.pid: label for p, label in self.find()})
        self.samples += 1
        self.device_mib = max(self.device_mib, used[0] if used else 0.0)
        self.unmatched_mib = max(self.unmatched_mib, other)
        self.total = max(self.total, int(sum(sites.values()) * 2**20))
        for label, mib in sites.items():
            self.parts[label] = max(self.parts.get(label, 0), int(mib * 2**20))

    def peak(self) -> dict:
        return {**super().peak(), "peak_device_gib": self.device_mib * 2**20 / GIB,
                "unmatched_gib": self.unmatched_mib * 2**20 / GIB, "failures": self.failures}


# ---- the runs -------------------------------------------------------------------------------------------------------
def repo_root() -> Path:
    """The checkout this package runs from (``custom/pflseg`` -> the repository root, which holds ``tests/``)."""
    return Path(__file__).resolve().parents[3]


def gpu_test_files(root: Path) -> list[Path]:
    """The test files that mark gpu tests (``pytest.mark.gpu``)."""
    return sorted(p for p in (root / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text(errors="replace"))


def run_tests(root: Path, timeout: float) -> dict:
    """Step 1: the gpu-marked tests in a subprocess; their counts, exit code and last lines."""
    files = gpu_test_files(root)
    if not files:
        return {"error": f"no test file under {root / 'tests'} marks gpu tests (run from a checkout of pflseg)"}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-n", "0", "-p", "no:randomly", "-p", "no:cacheprovider",
           *[str(f.relative_to(root)) for f in files]]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout)
        text, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        text, code = f"{partial}\nstopped after {timeout:.0f} s", None
    return {"command": " ".join(cmd[1:]), "returncode": code, "seconds": time.time() - t0, **pytest_counts(text),
            "tail": text.strip().splitlines()[-15:]}


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """Environment values for the simulator subprocesses started inside the block (``run_simulator`` passes this
    process's environment on)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def columns(job: str) -> list:
    """The table columns (``pflseg.flare.columns.Column``) a run of ``job`` is scored by: the demo's inside columns
    of that job, else the bench's."""
    from pflseg.eval.demo import INSIDE
    from pflseg.flare.methods import METHODS

    demo = [c for c in INSIDE if c.job == job]
    return demo or [c for entry in METHODS.values() for cols in entry.inside.values() for c in cols if c.job == job]


def run_dice(job: str, results: dict) -> dict[str, float | None]:
    """Column label -> test Dice, mean over the run's sites (``pflseg.flare.columns.site_test``)."""
    from pflseg.flare.columns import site_test

    out: dict[str, float | None] = {}
    for col in columns(job):
        scores = []
        for site in sorted(results.get("test", {})):
            try:
                scores.append(site_test(col, results, site).dice)
            except KeyError:  # not scored in this run (e.g. global_adabn with train.adabn off)
                continue
        values = [d for d in scores if d is not None]
        if scores:
            out[col.label] = statistics.mean(values) if values else None
    return out


def sim_run(ws: Path, step: dict, root: Path, overrides: dict, gpu: bool, progress) -> dict:
    """One simulator run of ``step`` (``pflseg.eval.speed.run_sim``, in ``<ws>/runs/<name>``) with the GPU's memory
    sampled per site when ``gpu``; its seconds per round, memory and Dice."""
    from pflseg.deploy.workspace import server_state
    from pflseg.eval import speed

    job, n = step["job"], step["sites"]
    run_ws = ws / "runs" / f"{step['step']}-{job}-{n}sites-amp-{step['amp']}"
    sampler = GpuSampler(named(run_ws.resolve() / "sim" / job / "sim")) if gpu else None
    t0 = time.time()
    with sampler or contextlib.nullcontext():
        run = speed.run_sim(run_ws, job, n, root, overrides, progress)
    seconds = time.time() - t0
    results = json.loads((server_state(run_ws / "sim" / job, job) / "results.json").read_text())
    costs = speed.round_costs(run["history"])
    host = run["memory"]
    memory = ({"kind": "gpu", **sampler.peak()} if sampler else
              {"kind": "host PSS (dry run)", **host})
    return {**step, "seconds": seconds, "seconds_per_round": costs["wall_s"], "compute_s": costs["compute_s"],
            "fixed_s": costs["fixed_s"], "history": run["history"], "executor": run["executor"],
            "memory": memory, "host_peak_site_max_gib": host.get("peak_site_max_gib"),
            "dice": run_dice(job, results), "job_dir": str(run_ws / "sim" / job / "job" / job)}


def _overrides(plan: Plan, step: dict) -> dict:
    from pflseg.eval import demo, speed

    sets: dict = {}
    extra = dict(plan.extra)
    speed._merge(sets, demo.SETTINGS)  # the demo's: its models segment within a few rounds
    if any(c.group != "unet" for c in columns(step["job"])):
        speed._merge(sets, {"net": demo.LCFED_NET})
        extra.pop("net", None)  # the extra net is a U-Net's
    if step["step"] in ("sites", "reference"):
        speed._merge(sets, plan.sites_extra)
    speed._merge(sets, extra)
    speed._merge(sets, {"train": {"amp": step["amp"]}})
    return speed.job_overrides(step["sites"], plan.rounds, step["size"] or demo_size(), sets)


def demo_size() -> int:
    from pflseg.data.synth import PRESETS
    from pflseg.eval.demo import PRESET

    return int(PRESETS[PRESET]["size"])


def demo_root(ws: Path, plan: Plan) -> Path:
    """The demo's data preset (at ``plan.size``; None: the preset's; with ``plan.split`` cases at every site and
    ``plan.depth`` slices where set), made once in ``<ws>/data``."""
    from pflseg.data import make_synthetic
    from pflseg.data.synth import PRESETS
    from pflseg.eval.demo import PRESET

    preset: str | dict = PRESET
    if plan.split is not None:
        spec = PRESETS[PRESET]
        preset = {**spec, "inside": tuple({**site, "split": plan.split} for site in spec["inside"]),
                  "outside_split": plan.split}
    root = ws / "data" / f"{PRESET}_size{plan.size or demo_size()}"
    if not (root / "dataset.json").is_file():
        make_synthetic(root, preset=preset, seed=0, size=plan.size, depth=plan.depth)
    return root


def sites_root(ws: Path, plan: Plan, n_sites: int) -> Path:
    """The data of the sites, reference and plain steps: ``pflseg.eval.speed.data_root``'s, or with ``plan.split``
    cases per site and ``plan.depth`` slices where set (made once in ``<ws>/data``)."""
    from pflseg.data import make_synthetic
    from pflseg.eval import speed

    if plan.split is None:
        return speed.data_root(ws, n_sites, plan.sites_size)
    root = ws / "data" / f"sites{n_sites}_size{plan.sites_size}_cases{sum(plan.split)}"
    if not (root / "dataset.json").is_file():
        make_synthetic(root, n_sites=n_sites + 1, cases=sum(plan.split), size=plan.sites_size, depth=plan.depth,
                       seed=0)
    return root


def run(workspace: str | Path, dry_run: bool = False, budget: float | None = None, progress=print) -> dict:
    """Every step of ``make_plan(dry_run)``; writes ``gpu.json`` and ``gpu.md`` in ``workspace``; returns the result
    ``to_markdown`` renders.

    Raises:
        RuntimeError: no CUDA device and not a dry run.
    """
    import torch

    from pflseg.deploy.workspace import job_config, workspace_lock
    from pflseg.eval import speed

    gpu = torch.cuda.is_available() and not dry_run
    if not gpu and not dry_run:
        raise RuntimeError("pflseg report gpu: no CUDA device here (torch.cuda.is_available() is False; "
                           f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); run it on a machine "
                           "with a GPU, or pass --dry-run to exercise it on the CPU")
    plan = make_plan(dry_run)
    progress(plan_text(plan, budget))
    ws = Path(workspace).resolve()
    result: dict = {"setup": {**asdict(plan), "budget_s": budget, "device": speed._device() if gpu else "cpu",
                              "torch": torch.__version__, "cuda": torch.version.cuda, "cores": os.cpu_count(),
                              "dice_tol": DICE_TOL, "amp_tol": AMP_TOL},
                    "tests": None, "runs": [], "plain": None, "skipped": [], "errors": []}
    t_start = time.time()
    # a dry run stays on the CPU on a GPU machine too: sites, plain loop and the gpu tests (skipped) see no CUDA
    hide = {"CUDA_VISIBLE_DEVICES": "", "PFLSEG_DEVICE": "cpu"} if dry_run else {}
    with workspace_lock(ws), _environ(**hide):
        for step in steps(plan):
            elapsed = time.time() - t_start
            if budget is not None and elapsed + step["estimate_s"] > budget:
                result["skipped"].append(f"{step['what']}: {elapsed:.0f} s spent, ~{step['estimate_s']:.0f} s more "
                                         f"would pass the budget of {budget:.0f} s")
                continue
            progress(f"[{step['step']}] {step['what']} ...")
            try:
                if step["step"] == "tests":
                    left = TESTS_TIMEOUT_S if budget is None else max(30.0, min(TESTS_TIMEOUT_S, budget - elapsed))
                    result["tests"] = run_tests(repo_root(), left)
                elif step["step"] == "plain":
                    ref = next(r for r in result["runs"] if r["step"] == "sites" and r["sites"] == step["sites"])
                    names = [f"site-{i + 1}" for i in range(step["sites"])]
                    t0 = time.time()
                    plain = speed.plain_rounds(sites_root(ws, plan, step["sites"]), names,
                                               job_config(ref["job_dir"]), plan.rounds,
                                               speed.threads_per_site(step["sites"]))
                    row = speed.compare(speed.round_costs(ref["history"]), plain)
                    result["plain"] = {**step, **row, "seconds": time.time() - t0, "per_site": plain}
                else:
                    root = demo_root(ws, plan) if step["step"] == "amp" else sites_root(ws, plan, step["sites"])
                    env = {"PFLSEG_DEVICE": "cpu"} if step["device"] == "cpu" else {}
                    with _environ(**env):
                        result["runs"].append(sim_run(ws, step, root, _overrides(plan, step),
                                                      gpu and step["device"] != "cpu", progress))
            except Exception as exc:  # noqa: BLE001 - named in the report; the other steps go on
                result["errors"].append(f"{step['what']}: {type(exc).__name__}: {exc}")
        result["seconds"] = time.time() - t_start
        (ws / RESULTS_JSON).write_text(json.dumps(result, indent=1, default=str))
        text = to_markdown(result)
        (ws / MARKDOWN).write_text(text + "\n")
    return result


# ---- the table (pure) -----------------------------------------------------------------------------------------------
def _memory(run_: dict) -> str:
    """Memory per site: the largest site and every site, GiB; the whole GPU where no PID matched a site."""
    m = run_.get("memory") or {}
    sites = m.get("peak_site_gib") or {}
    if sites:
        cell = f"{max(sites.values()):.2f} (" + ", ".join(f"{v:.2f}" for _, v in sorted(sites.items())) + ")"
    elif m.get("peak_device_gib"):
        cell = f"no site PID seen; whole GPU {m['peak_device_gib']:.2f}"
    else:
        cell = "-"
    return cell + (" host PSS, dry run" if m.get("kind", "").startswith("host") and sites else "")


def _dice(run_: dict) -> str:
    return ", ".join(f"{label} {_num(v, 3)}" for label, v in (run_.get("dice") or {}).items()) or "-"


def dice_pairs(runs: list[dict], what: str) -> list[dict]:
    """Dice of runs that should agree, per column label: ``what`` = "cpu" pairs each sites run with the reference
    run of the same sites (tolerance ``DICE_TOL``); "amp" pairs each method's bf16 run with its amp-off run
    (``AMP_TOL``)."""
    out = []
    if what == "cpu":
        pairs = [(a, b) for a in runs if a["step"] == "sites" for b in runs
                 if b["step"] == "reference" and (b["job"], b["sites"]) == (a["job"], a["sites"])]
        tol = DICE_TOL
    else:
        pairs = [(a, b) for a in runs if a["step"] == "amp" and a["amp"] != "off" for b in runs
                 if b["step"] == "amp" and b["amp"] == "off" and b["job"] == a["job"]]
        tol = AMP_TOL
    for a, b in pairs:
        for label, value in (a.get("dice") or {}).items():
            other = (b.get("dice") or {}).get(label)
            delta = None if value is None or other is None else value - other
            out.append({"job": a["job"], "sites": a["sites"], "label": label, "amp": a["amp"], "dice": value,
                        "reference": other, "delta": delta, "tolerance": tol,
                        "ok": None if delta is None else abs(delta) <= tol})
    return out


def _verdict(ok: bool | None) -> str:
    return {True: "yes", False: "**NO**", None: "-"}[ok]


def to_markdown(result: dict) -> str:
    """The report: setup line, tests, the runs table (seconds per round, memory per site, Dice), site compute against
    the plain loop, Dice against the CPU and with bf16 against without, skipped steps and errors."""
    s = result["setup"]
    dry = s.get("dry_run")
    mark = " **(dry run: CPU, smallest sizes; not a GPU measurement)**" if dry else ""
    lines = [f"GPU check on {s.get('device', '?')}, torch {s.get('torch', '?')} (CUDA {s.get('cuda') or '-'}), "
             f"{s['rounds']} round(s) per run, {_num(result.get('seconds'), 0)} s in all{mark}", ""]
    t = result.get("tests")
    lines.append("**gpu-marked tests**" + (" (dry run: no CUDA, so they are skipped)" if dry else "") + ": " + (
        "not run" if not t else t["error"] if "error" in t else
        f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped, {t['errors']} errors "
        f"({_num(t['seconds'], 0)} s; exit {t['returncode']}): `{t['command']}`"))
    runs = result.get("runs") or []
    head = ["step", "job", "sites", "train.amp", "device", "s / round", "site compute s", "fixed s / round",
            "memory per site GiB: largest (each)", "test Dice (mean over sites)", "run s"]
    body = [[r["step"], r["job"], r["sites"], r["amp"], r["device"], _num(r.get("seconds_per_round")),
             _num(r.get("compute_s")), _num(r.get("fixed_s")), _memory(r), _dice(r), _num(r.get("seconds"), 0)]
            for r in runs]
    lines += ["", "**Runs** (FLARE simulator; s / round: the server's round wall, median over rounds 1.., round 0 "
              "when there is one round only; memory: nvidia-smi per site process, CUDA context included)", "",
              markdown_table(head, body) if body else "no run completed"]
    p = result.get("plain")
    if p:
        lines += ["", f"**Site compute vs a plain PyTorch loop** on {p['device']} (FedAvg, {p['sites']} sites, amp "
                      "off; the plain loop of `pflseg report speed`)", "",
                  markdown_table(["job", "sites", "plain loop s", "site compute s", "compute / plain"],
                                 [[p["job"], p["sites"], _num(p.get("plain_s")), _num(p.get("compute_s")),
                                   _num(p.get("ratio"))]])]
    for what, title in (("cpu", f"**Dice on the device vs the CPU** (same seed and config; |Δ| <= {DICE_TOL}: "
                                "TF32 convolutions and other summation orders, see gpu.py's DICE_TOL)"),
                        ("amp", f"**Dice with bf16 vs without** (same device; |Δ| <= {AMP_TOL}: two rounds are early "
                                "training, a broken bf16 path shows as Dice near 0 or NaN)")):
        pairs = dice_pairs(runs, what)
        if pairs:
            lines += ["", title, "", markdown_table(
                ["job", "sites", "column", "Dice", "reference Dice", "Δ", "within tolerance"],
                [[d["job"], d["sites"], d["label"], _num(d["dice"], 3), _num(d["reference"], 3),
                  _num(d["delta"], 3) if d["delta"] is None else f"{d['delta']:+.3f}", _verdict(d["ok"])]
                 for d in pairs])]
    if result.get("skipped"):
        lines += ["", *[f"skipped: {x}" for x in result["skipped"]]]
    if result.get("errors"):
        lines += ["", *[f"error: {e}" for e in result["errors"]]]
    return "\n".join(lines)


# ---- command line ---------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``pflseg report gpu``."""
    parser.add_argument("--workspace", default=None, help="folder of the data, runs and report (default: runs/gpu)")
    parser.add_argument("--dry-run", action="store_true",
                        help="every step on the CPU at the smallest sizes (about 2 min; what the tests run)")
    parser.add_argument("--plan", action="store_true", help="print what would run and its estimate; run nothing")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="skip the steps that would end past this many seconds (default 570; dry run: none)")


def report(**flags) -> str:
    """``pflseg report gpu``: ``run`` (with ``plan``: only the plan); its Markdown (also in ``<workspace>/gpu.md``)."""
    dry = bool(flags.get("dry_run"))
    budget = flags.get("budget")
    budget = (None if dry else 570.0) if budget is None else float(budget)
    if flags.get("plan"):
        return plan_text(make_plan(dry), budget)
    return to_markdown(run(flags.get("workspace") or "runs/gpu", dry_run=dry, budget=budget))
