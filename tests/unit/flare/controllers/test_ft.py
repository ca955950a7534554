"""FT's controller with a stubbed transport: every site fine-tunes the best global model; results.json's ``ft``."""

from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.flare.wire import GLOBAL, prefixed
from tests.unit.flare.controllers.conftest import Stub, make


def test_ft_fine_tunes_the_best_global_model_at_every_site(tmp_path, monkeypatch):
    ctrl = make("ft", tmp_path, monkeypatch)
    best = prefixed(GLOBAL, ctrl.state.global_state)
    stub = Stub(ctrl, lambda site, data: FLModel(params={}, metrics={"ft_best_epoch": 1, "ft_val_dice": [0.2, 0.3]}))
    entries = ctrl.personalize(2, best)
    assert [(t, s) for t, s, _ in stub.sent] == [("finetune", s) for s in ctrl.sites]
    assert all(d.params is best or d.params == best for _, _, d in stub.sent)
    assert entries["ft"]["site-2"] == {"best_epoch": 1, "val_dice": [0.2, 0.3]}
