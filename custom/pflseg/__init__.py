"""pflseg: personalized federated segmentation of medical images on NVIDIA FLARE."""

import importlib.abc
import importlib.machinery
import sys

__version__ = "0.1.0"

#: packages MONAI imports when they are installed (its ``__init__`` loads every submodule, and those integrations
#: with them) that pflseg never uses through MONAI; hidden while MONAI itself is imported (``_LeanMonai``). SciPy's
#: signal, sparse, optimize, spatial and stats serve only MONAI parts pflseg does not use (ultrasound confidence maps,
#: DiNTS, notch filters, panoptic quality, sub-voxel surface distances) and were 1.3 s of the 3.0 s MONAI took to
#: import after torch, in every site and server process (scipy.ndimage, which the surface distances need, stays)
MONAI_EXTRAS = ("ignite", "matplotlib", "mlflow", "pandas", "sklearn", "skimage", "tensorboard", "wandb",
                "scipy.signal", "scipy.sparse", "scipy.optimize", "scipy.spatial", "scipy.stats")


class _LeanMonai(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """MONAI without the integrations pflseg does not use: while ``monai`` is first executed, ``MONAI_EXTRAS`` not
    imported yet look absent to it (MONAI then keeps placeholders that only fail when such an integration is used).
    A site process then holds torch and MONAI's core only: about 0.1-0.25 GiB less per site (docs/speed.md,
    "Memory"). Once MONAI is in, every package imports as usual for everyone else."""

    def find_spec(self, name, path=None, target=None):
        if name != "monai":
            return None
        sys.meta_path.remove(self)  # one look: the real finders find MONAI; this one only wraps its execution
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self._loader
        hidden = [name for name in MONAI_EXTRAS if name not in sys.modules]
        sys.modules.update(dict.fromkeys(hidden))  # None in sys.modules: "import x" raises ImportError
        try:
            self._loader.exec_module(module)
        finally:
            for name in hidden:
                if name in sys.modules and sys.modules[name] is None:
                    del sys.modules[name]


if "monai" not in sys.modules:
    sys.meta_path.insert(0, _LeanMonai())
