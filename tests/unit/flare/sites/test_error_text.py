"""Issue 39 F3: whatever raises inside a site's task (the OS, PIL, nibabel, MONAI, torch, numpy, FLARE, a KeyError or
ValueError, ``write_predictions`` of a post-training job, pflseg's own code), nothing of a patient-like file name
leaves the site. Each kind is raised from inside a real site's ``train`` task and answered by FLARE's executor path
(``SiteExecutor.execute``: ``client.answer`` -> the site's one exit ``pflseg.flare.outbox.leave``); the reply (every
string of the Shareable), every log record (what FLARE's log, which FLARE can stream to the server, would carry)
and the analytics events are searched. The detail stays in the site-local ``site_errors.log``."""

import errno
import json
import logging
import os
import re
import zipfile

import numpy as np
import pytest
import torch
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.signal import Signal
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from pflseg.flare.executor import SiteExecutor
from tests.unit.flare.test_executor import context, task

SECRETS = ("Smith", "MRN4711")
NAME = "Smith_John_MRN4711_1960-01-01"


def _open_missing(d):
    open(d / f"{NAME}.png", "rb")


def _pil_corrupt(d):
    from PIL import Image

    Image.open(d / "corrupt" / f"{NAME}.png")


def _nibabel_corrupt(d):
    import nibabel as nib

    nib.load(str(d / "corrupt" / f"{NAME}.nii"))


def _monai_corrupt(d):
    from monai.transforms import LoadImage

    LoadImage(image_only=True)(str(d / "corrupt" / f"{NAME}.png"))


def _torch_load_corrupt(d):
    torch.load(d / "corrupt" / f"{NAME}.pt", weights_only=True)


def _numpy_load_corrupt(d):
    np.load(d / "corrupt" / f"{NAME}.npy")


def _is_a_directory(d):
    (d / "folder" / f"{NAME}.png").mkdir(parents=True, exist_ok=True)
    open(d / "folder" / f"{NAME}.png", "rb")


def _not_a_directory(d):
    os.listdir(d / "corrupt" / f"{NAME}.png")


def _permission(d):
    raise PermissionError(errno.EACCES, "Permission denied", str(d / f"{NAME}.png"))


def _disk_full(d):
    raise OSError(errno.ENOSPC, "No space left on device", str(d / "cache" / f"{NAME}.png"))


def _json_of_a_patient(d):
    json.loads((d / "corrupt" / f"{NAME}.png").read_bytes().decode("latin-1"))


def _unicode(d):
    (d / "corrupt" / f"{NAME}.png").read_text(encoding="utf-8")


def _zip(d):
    zipfile.ZipFile(d / "corrupt" / f"{NAME}.png")


def _value_error(d):
    raise ValueError(f"cannot decode slice 3 of {d / NAME}.png: bad header")


def _key_error(d):
    {}[NAME]


def _runtime_error(d):
    raise RuntimeError(f"CUDA error while loading '{d / NAME}.nii.gz'")


def _type_error(d):
    raise TypeError(f"expected str, got {NAME}")


def _assertion(d):
    assert False, f"shape of {NAME}.png"


def _chained(d):
    try:
        open(d / f"{NAME}.png", "rb")
    except FileNotFoundError as exc:
        raise RuntimeError(f"decoder failed on {exc.filename}") from exc


def _flare_task_failure(d):
    from nvflare.apis.fl_exception import TaskExecutionError

    raise TaskExecutionError(f"task failed reading /data/{NAME}.png")


def _write_predictions(d):
    from pflseg.train.predictions import write_predictions

    item = {"preds": {"m": torch.ones(1, 4, 4, dtype=torch.bool)}, "choice": {"routing": "m"}, "slice": 0}
    write_predictions({"c1": [item]}, {"c1": "pred_c1"}, "routing", d / "predictions", "nested",
                      sources={"c1": [(0, d / "gone" / f"{NAME}.png")]})  # the source image went away meanwhile


def _pflseg_value_error(d):
    from pflseg.flare.state import state_dir

    state_dir("site-1", str(d / f"{NAME}.png"))  # pflseg's own words, naming the folder


def _pflseg_data_error(d):
    from pflseg.data.errors import unreadable

    raise unreadable("site-1", d / "corrupt" / f"{NAME}.png", ValueError("truncated")).error()


def _spaces(d):
    raise OSError("cannot open '/data/Smith John MRN4711.png'")


KINDS = [_open_missing, _pil_corrupt, _nibabel_corrupt, _monai_corrupt, _torch_load_corrupt, _numpy_load_corrupt,
         _is_a_directory, _not_a_directory, _permission, _disk_full, _json_of_a_patient, _unicode, _zip, _value_error,
         _key_error, _runtime_error, _type_error, _assertion, _chained, _flare_task_failure, _write_predictions,
         _pflseg_value_error, _pflseg_data_error, _spaces]


@pytest.fixture
def data(tmp_path):
    d = tmp_path / "data"
    (d / "corrupt").mkdir(parents=True)
    for suffix in (".png", ".nii", ".pt", ".npy"):
        (d / "corrupt" / f"{NAME}{suffix}").write_bytes(b"\x89not an image \xff\xfe of " + NAME.encode())
    return d


def strings(value):
    if isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from strings(item)
    elif not torch.is_tensor(value):
        yield str(value)


@pytest.mark.parametrize("kind", KINDS, ids=lambda f: f.__name__.strip("_"))
def test_no_exception_of_a_task_carries_a_patient_file_name_off_the_site(kind, data, federation, tmp_path,
                                                                           monkeypatch, caplog):
    site = federation("fedavg").site()
    raised = []

    def body(msg):
        try:
            kind(data)
        except Exception as exc:
            raised.append(exc)
            raise
        raise AssertionError(f"{kind.__name__} raised nothing")

    monkeypatch.setattr(site, "tasks", lambda: {"train": body})
    fired = []
    monkeypatch.setattr(SiteExecutor, "fire_event", lambda self, event, ctx: fired.append(event))
    ex = SiteExecutor()
    ex._site = site
    with caplog.at_level(logging.DEBUG):
        reply = ex.execute("train", task(r=0), context(job="simulate_job"), Signal())
    assert raised, "the task raised nothing"
    assert reply.get_return_code() == ReturnCode.OK  # an error reply: the server leaves the site out of the round
    error = FLModelUtils.from_shareable(reply).meta["pflseg_error"]
    assert error.startswith("site site-1: ") and error.endswith("(detail in the site's <state>/site_errors.log)")
    server_side = list(strings(dict(reply))) + [r.getMessage() for r in caplog.records] + [str(e) for e in fired]
    leaked = [s for s in server_side if any(secret in s for secret in SECRETS)]
    assert not leaked, leaked
    local = (tmp_path / "state" / "site-1" / "site_errors.log").read_text()
    assert error.split(" (detail")[0] in local and "Traceback" in local  # the operator's detail stays at the site
    if any(secret in str(raised[0]) for secret in SECRETS):
        assert any(secret in local for secret in SECRETS)
    for pseudonym in re.findall(r"file-[0-9a-f]{16}", error):  # every pseudonym is resolved in the local log
        assert f"  {pseudonym} = " in local, pseudonym
