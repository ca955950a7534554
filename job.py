"""Run a pflseg job with FLARE's SimEnv from Python (the `python job.py` route).

    python job.py fedavg --sites 3 --rounds 2 --workspace /tmp/pflseg_sim

The job is built from app_configs/<name>.yaml exactly as `pflseg jobs export` builds jobs/<name>/.
"""

import argparse

from pflseg.config import parse_set
from pflseg.deploy.simulator import run_simenv

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job")
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--threads", type=int)
    p.add_argument("--rounds", type=int)
    p.add_argument("--workspace", default="runs/simenv")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = p.parse_args()
    overrides = parse_set(args.set)
    if args.rounds:
        overrides["rounds"] = args.rounds
    print(run_simenv(args.job, args.workspace, n_sites=args.sites, threads=args.threads, overrides=overrides))
