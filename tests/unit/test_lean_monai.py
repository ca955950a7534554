"""``import pflseg`` makes MONAI import without the integrations pflseg never uses (pflseg.MONAI_EXTRAS), in a fresh
interpreter as a site process is; they import as usual afterwards, and MONAI's pieces pflseg uses still work."""

import subprocess
import sys

CHECK = """
import sys
import pflseg
from pflseg.nets import build_net  # the first import of MONAI, as at a site
extras = [m for m in pflseg.MONAI_EXTRAS if m in sys.modules]
assert not extras, f"imported with MONAI: {extras}"
assert all(sys.modules.get(m, 0) is not None for m in pflseg.MONAI_EXTRAS), "a hidden package left as None"
import monai
assert type(monai.__loader__).__name__ == "SourceFileLoader", monai.__loader__
from monai.metrics import compute_average_surface_distance  # scipy.ndimage: not hidden
import torch
seg = torch.zeros(1, 1, 8, 8); seg[..., 2:5, 2:5] = 1
print(float(compute_average_surface_distance(seg, seg.roll(1, -1)).item()))
import matplotlib  # installed with the test extra: imports as usual once MONAI is in
from scipy.stats import t  # as the bench's intervals import it
assert t.ppf(0.975, 2) > 4
"""


def test_monai_imports_without_its_unused_integrations_and_they_import_later():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.strip().splitlines()[-1]) > 0
