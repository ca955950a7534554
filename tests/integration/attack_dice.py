"""Issue 39's measured attack table, in real FLARE simulator runs: honest sites' test Dice with one lying site.

For FedAvg and GRACE (attacks ``scaled``, ``flipped``, ``fixed``: issue 39 F1, F6) and FedSM, IOP-FL and LC-Fed
(``scaled``; their personalized models scored, ``MODEL``) on the demo preset's three inside sites
(``pflseg.data.synth.PRESETS["demo"]``, seeds as given; ``--inside 5``: ``DEMO5``, the bench's five inside sites at
the demo's size), each attack runs with the last, smallest site (site-3; site-5) as the liar
(tests/integration/evil/sitecustomize.py: its true update x 99, x -99 or a fixed direction of 99x its norm, and n_k
99x its honest value) next to the honest run of the same seed, with the job defaults (``robust``: clip 3, n_k cap
6, norm bound 100; min_clients 2: a refused liar is left out, the job goes on) and the demo's training settings
(``pflseg.eval.demo.SETTINGS``). The runs are ``pflseg bench``'s (``Bench.run``: one at a time, read back when
finished with the same settings, resumed when stopped). Writes
``<workspace>/attack_dice.md`` (and .json)::

    OMP_NUM_THREADS=1 python -m tests.integration.attack_dice --workspace DIR --seeds 0 1 --rounds 10 [--inside 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from datetime import datetime
from pathlib import Path

from pflseg.config import parse_set
from pflseg.data import load_dataset_info, make_synthetic
from pflseg.data.synth import PRESETS
from pflseg.eval.bench import Bench
from pflseg.eval.demo import SETTINGS

EVIL = Path(__file__).resolve().parent / "evil"
#: K = 5: the bench preset's five inside sites at the demo's size and splits (training cases 12 / 6 / 3 / 3 / 2)
DEMO5 = {**PRESETS["demo"], "inside": tuple({**site, "split": (n_train, 2, 5)}
                                            for site, n_train in zip(PRESETS["bench"]["inside"], (12, 6, 3, 3, 2)))}


def roles(inside: int = 3) -> tuple[str, list[str]]:
    """The liar (the last, smallest inside site) and the honest sites of a federation of ``inside`` sites."""
    return f"site-{inside}", [f"site-{i}" for i in range(1, inside)]
#: method (job) -> the attacks run against it, besides the honest run
ATTACKS = {"fedavg": ("scaled", "flipped", "fixed"), "grace": ("scaled", "flipped", "fixed"),
           "fedsm": ("scaled",), "iopfl": ("scaled",), "lcfed": ("scaled",)}
#: method -> the honest sites' model the table scores (results["test"][site][key]): the global model where the method
#: reports one as its own, else the site's personalized model (FedSM's P_k, IOP-FL's P_k, LC-Fed's calibrated model)
#: controls, run only when named in --attacks: ``dropout``, the liar's path without the lie (honest in round 1, then
#: refused), which separates the lie's harm from the loss of the liar's data
CONTROLS = ("dropout",)
MODEL = {"fedavg": "global", "grace": "global", "fedsm": "site", "iopfl": "site", "lcfed": "site"}
LABELS = {"fedavg": "FedAvg", "grace": "GRACE", "fedsm": "FedSM personalized", "iopfl": "IOP-FL P_k",
          "lcfed": "LC-Fed", "scaled": "scaled 99x, n_k 99x (F1/F6)",
          "flipped": "sign-flipped 99x, n_k 99x (F1)", "fixed": "fixed direction 99x, n_k 99x (F1)",
          "dropout": "control: honest in round 1, then refused"}


class AttackBench(Bench):
    """``Bench`` with the job default ``min_clients: 2`` (Bench asks every site of a run to answer every round, so a
    refused liar would stop the job instead of being left out)."""

    def job_overrides(self, seed: int, fold: str, job: str) -> dict:
        return {**super().job_overrides(seed, fold, job), "min_clients": 2}


def data_root(workspace: Path, seed: int, inside: int = 3) -> Path:
    root = workspace / "data" / (f"seed{seed}" if inside == 3 else f"k{inside}_seed{seed}")
    if not (root / "dataset.json").is_file():
        make_synthetic(root, preset="demo" if inside == 3 else DEMO5, seed=seed)
    return root


def liar_env(attack: str | None, factor: float = 99.0, liar: str = "site-3") -> None:
    """This process's environment for the next run (the simulator's processes inherit it): ``attack`` at ``liar`` with
    its update x ``factor``, or an honest run (None)."""
    for key in ("PFLSEG_TEST_EVIL_SITE", "PFLSEG_TEST_EVIL_ATTACK", "PFLSEG_TEST_EVIL_FACTOR"):
        os.environ.pop(key, None)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(EVIL)]
    if attack is not None:
        os.environ.update(PFLSEG_TEST_EVIL_SITE=liar, PFLSEG_TEST_EVIL_ATTACK=attack,
                          PFLSEG_TEST_EVIL_FACTOR=str(factor))
        paths.insert(0, str(EVIL))
    if paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    else:
        os.environ.pop("PYTHONPATH", None)


def run(workspace: Path, job: str, attack: str | None, seed: int, rounds: int, table_only: bool = False,
        sets: dict | None = None, factor: float = 99.0, inside: int = 3) -> dict | None:
    """One simulator run (read back when it finished earlier): the summary of its results.json; with ``table_only``
    a run that did not finish earlier is not run (None). ``sets``: more job overrides (``--set``, e.g. robust.clip)."""
    liar, honest = roles(inside)
    root = data_root(workspace, seed, inside)
    settings = {k: v for k, v in SETTINGS.items() if k != "privacy"}
    overrides = {**settings, "data": {"size": load_dataset_info(root)["train_size"]}}
    for section, value in (sets or {}).items():  # --set keys beside (or inside) the demo's settings
        overrides[section] = {**overrides.get(section, {}), **value} if isinstance(value, dict) else value
    bench = AttackBench(workspace / (attack or "honest"), data=root, methods=[job], seeds=[seed], rounds=rounds,
                  sites=[*honest, liar], outside=False, overrides=overrides, preset=None, progress=print)
    if table_only and not bench.finished(seed, "inside", job):
        return None
    liar_env(attack, factor, liar)
    try:
        res = bench.run(seed, "inside", job)
    finally:
        liar_env(None)
    record = json.loads((bench.run_dir(seed, "inside", job) / "run.json").read_text())
    wall = (datetime.fromisoformat(record["finished"]) - datetime.fromisoformat(record["started"])).total_seconds()
    history = res.get("history", [])
    lies = [(h.get("site_metrics") or {}).get(liar, {}) for h in history]
    return {"dice": {s: res["test"][s][MODEL[job]]["dice"] for s in honest},
            "left_out": sum(liar not in (h.get("site_metrics") or {}) for h in history),
            "clipped": sum("update_clipped" in m for m in lies), "capped": sum("n_k_capped" in m for m in lies),
            "ratio": max((m.get("update_ratio", 0.0) for m in lies), default=0.0),
            "rounds": len(history), "missing": res.get("missing", {}).get(liar), "wall_s": round(wall)}


def summary(runs: dict, job: str, attack: str, seeds: list[int]) -> dict:
    """One row: the honest sites' mean test Dice per seed, attacked and honest, and their paired difference."""
    att = [statistics.mean(runs[(job, attack, s)]["dice"].values()) for s in seeds]
    hon = [statistics.mean(runs[(job, None, s)]["dice"].values()) for s in seeds]
    return {"attacked": att, "honest": hon, "diff": [a - h for a, h in zip(att, hon)]}


def to_markdown(runs: dict, seeds: list[int], rounds: int, factor: float = 99.0, inside: int = 3) -> str:
    liar, honest = roles(inside)
    cols = ["method", f"liar's attack ({liar})"]
    cols += [f"seed {s}: attacked / honest" for s in seeds]
    cols += ["mean attacked / honest", "paired diff (mean; per seed)", "liar left out (rounds)",
             "liar clipped (rounds)", "liar n_k capped (rounds)", "liar's largest update ratio (accepted rounds)",
             f"missing ({liar})"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for job, attacks in ATTACKS.items():
        for attack in attacks + CONTROLS:
            if not all((job, a, s) in runs for a in (None, attack) for s in seeds):
                continue
            row = summary(runs, job, attack, seeds)
            per = [runs[(job, attack, s)] for s in seeds]
            cells = [LABELS[job], LABELS[attack].replace("99x, n_k", f"{factor:g}x, n_k", 1)]
            cells += [f"{a:.3f} / {h:.3f}" for a, h in zip(row["attacked"], row["honest"])]
            cells += [f"{statistics.mean(row['attacked']):.3f} / {statistics.mean(row['honest']):.3f}",
                      f"{statistics.mean(row['diff']):+.3f} ({'; '.join(f'{d:+.3f}' for d in row['diff'])})",
                      " / ".join(f"{p['left_out']} of {p['rounds']}" for p in per),
                      " / ".join(f"{p['clipped']} of {p['rounds']}" for p in per),
                      " / ".join(f"{p['capped']} of {p['rounds']}" for p in per),
                      " / ".join(f"{p['ratio']:.1f}x" if p["ratio"] else "-" for p in per),
                      " / ".join(p["missing"] or "-" for p in per)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + (f"\n\nHonest sites: {', '.join(honest)} (test Dice of the model MODEL names: the "
                               f"global model for FedAvg and GRACE, else the personalized one; mean of the "
                               f"{len(honest)}); {rounds} rounds; seeds {', '.join(map(str, seeds))}; per-seed cells "
                               "\"seed 0 / seed 1\".\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workspace", required=True, type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--methods", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    parser.add_argument("--attacks", nargs="+",
                        choices=sorted({a for v in ATTACKS.values() for a in v} | set(CONTROLS)),
                        help="only these attacks (default: each method's, ATTACKS; CONTROLS only when named); the "
                        "honest runs always")
    parser.add_argument("--table-only", action="store_true", help="run nothing: the table of the finished runs")
    parser.add_argument("--factor", type=float, default=99.0,
                        help="the liar's update factor (default 99; n_k is declared 99x whatever it is; use a "
                             "workspace per factor)")
    parser.add_argument("--inside", type=int, choices=(3, 5), default=3,
                        help="inside sites K: 3 (the demo preset) or 5 (DEMO5); the last one lies (a workspace per K)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a job override for every run, e.g. robust.clip=1 (use a workspace per setting)")
    args = parser.parse_args(argv)
    sets = parse_set(args.sets)
    ws = args.workspace.resolve()
    ws.mkdir(parents=True, exist_ok=True)
    runs: dict = {}
    # every method's first attack and honest run before the other attacks (the first attack before the honest run:
    # the injection is seen to work early)
    attacks = {job: [a for a in ATTACKS[job] + CONTROLS if a in (args.attacks or ATTACKS[job])] for job in args.methods}
    plan = [(job, a) for job in args.methods for a in (*attacks[job][:1], None)]
    plan += [(job, a) for job in args.methods for a in attacks[job][1:]]
    for job, attack in plan:
        for seed in args.seeds:
            out = run(ws, job, attack, seed, args.rounds, args.table_only, sets, args.factor, args.inside)
            if out is None:
                continue
            runs[(job, attack, seed)] = out
            print(f"{job} {attack or 'honest'} seed {seed}: {json.dumps(out)}", flush=True)
            (ws / "attack_dice.json").write_text(json.dumps(
                {f"{j}/{a or 'honest'}/{s}": v for (j, a, s), v in runs.items()}, indent=1))
            (ws / "attack_dice.md").write_text(to_markdown(runs, args.seeds, args.rounds, args.factor, args.inside))
    print(to_markdown(runs, args.seeds, args.rounds, args.factor, args.inside))


if __name__ == "__main__":
    main()
