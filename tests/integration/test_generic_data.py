"""A hospital's own data, as it comes: RGB PNG images and {0, 127} masks in site folders named after the
hospitals ("Hospital A" is no valid FLARE client name), indexed with the generic layout, then
``pflseg run fedavg --data ROOT`` with no --set: the data's sites, channels and training size are used."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pflseg.cli import main
from pflseg.eval.plots import have_matplotlib

pytestmark = pytest.mark.slow
H, W = 40, 48  # median short side 40 -> train_size 32


def _case(rng: np.random.Generator, tint: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(H, W, 3) uint8 image with a bright ellipse on noise; (H, W) uint8 mask, 127 inside the ellipse."""
    yy, xx = np.mgrid[:H, :W]
    cy, cx = rng.uniform(12, H - 12), rng.uniform(12, W - 12)
    ry, rx = rng.uniform(5, 10, size=2)
    inside = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1
    image = rng.normal(60, 20, size=(H, W, 3)) + inside[..., None] * np.array(tint)
    return np.clip(image, 0, 255).astype(np.uint8), (inside * 127).astype(np.uint8)


def write_hospitals(raw: Path, sites=("Hospital A", "Clinic_B"), n_train: int = 6, n_test: int = 2) -> Path:
    """<raw>/<site>/{train,test}/{images,masks}/<name>.png (the published split)."""
    rng = np.random.default_rng(0)
    for k, site in enumerate(sites):
        for part, n in (("train", n_train), ("test", n_test)):
            for i in range(n):
                image, mask = _case(rng, (120, 90 + 40 * k, 60))
                for sub, array in (("images", image), ("masks", mask)):
                    path = raw / site / part / sub / f"img{i:02d}.png"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    Image.fromarray(array).save(path)
    return raw


def test_run_on_a_hospitals_own_data(tmp_path, capsys):
    root = tmp_path / "root"
    assert main(["data", "index", "--layout", "generic", "--root", str(write_hospitals(tmp_path / "raw")),
                 "--out", str(root)]) == 0
    info = json.loads((root / "dataset.json").read_text())
    assert (info["sites"], info["in_channels"], info["train_size"]) == (["Clinic_B", "Hospital A"], 3, 32)
    ws = tmp_path / "ws"
    capsys.readouterr()

    assert main(["run", "fedavg", "--data", str(root), "--rounds", "2", "--workspace", str(ws)]) == 0

    out = capsys.readouterr().out
    assert "'Hospital A' as 'Hospital_A'" in out
    results = json.loads((ws / "state" / "server" / "fedavg" / "results.json").read_text())
    assert sorted(results["test"]) == ["Clinic_B", "Hospital_A"] and not results["missing"]
    cfg = results["config"]
    assert (cfg["net"]["in_channels"], cfg["net"]["out_channels"], cfg["data"]["size"]) == (3, 1, 32)
    assert json.loads((ws / "data_view" / "dataset.json").read_text())["sites"] == ["Clinic_B", "Hospital_A"]
    assert (ws / "data_view" / "Hospital_A").resolve() == (root / "Hospital A").resolve()
    csv_lines = (ws / "results" / "test.csv").read_text().splitlines()
    # global, global_adabn, site
    assert csv_lines[0].startswith("site,model,reported,dice") and len(csv_lines) == 1 + 2 * 3
    assert "| Hospital_A | global | yes |" in (ws / "results" / "test.md").read_text()
    for site in ("Clinic_B", "Hospital_A"):  # two test cases each: the worst and the best
        overlays = sorted(p.name for p in (ws / "state" / site / "fedavg" / "overlays").glob("*.png"))
        assert overlays == ["best-1_test_img00.png", "worst-1_test_img01.png"] or \
            overlays == ["best-1_test_img01.png", "worst-1_test_img00.png"], overlays
        with Image.open(ws / "state" / site / "fedavg" / "overlays" / overlays[0]) as im:
            assert im.mode == "RGB" and im.width > 3 * 32
        assert f"overlays at {site}:" in out
    assert (ws / "results" / "val_dice.png").is_file() == have_matplotlib()
