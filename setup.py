"""Build step of the wheel (the metadata is in pyproject.toml): the repository's top-level ``app_configs/`` and
``provisioning/``, the one hand-edited source of every job and of the deployment template, are copied into the
package as ``pflseg/_data/app_configs/`` and ``pflseg/_data/provisioning/``, which an installed pflseg reads
with ``importlib.resources`` (``pflseg.config.resource_dir``). An editable install reads the checkout's folders."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
SHIPPED = {"app_configs": "*.yaml", "provisioning": "*.yml"}


class BuildWithData(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for folder, pattern in SHIPPED.items():
            files = sorted(p for p in (HERE / folder).glob(pattern) if p.is_file())
            if not files:
                raise SystemExit(f"setup.py: no {pattern} in {HERE / folder}: build from a checkout or sdist of pflseg")
            target = Path(self.build_lib) / "pflseg" / "_data" / folder
            target.mkdir(parents=True, exist_ok=True)
            for path in files:
                shutil.copy2(path, target / path.name)


setup(cmdclass={"build_py": BuildWithData})
