"""The server's final checkpoint holds exactly the models the training job's final test scored (what the
post-training bundles read), and FedSM's gamma is chosen on validation, never on test."""

import torch
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.flare.controllers.fedsm import choose_gamma
from pflseg.flare.state import unprefixed
from tests.unit.flare.test_controllers import Stub, make, scaled


def test_final_checkpoint_holds_the_tested_models(tmp_path, monkeypatch):
    ctrl = make("fedsm", tmp_path, monkeypatch)
    ctrl.get_run_dir = lambda: str(tmp_path / "run")
    ctrl.abort_signal = Signal()

    def reply(site, data):
        task = stub.sent[-1][0]
        if task == "train":  # every site returns what it got, scaled: the aggregate changes every round
            params = {k: v * 1.5 if v.is_floating_point() else v for k, v in data.params.items() if not k.startswith("moment")}
            params.update({k: torch.zeros_like(v) for k, v in ctrl.moment_ref.items()})  # the selector's Adam moments
            return FLModel(params=params, metrics={"val_dice": 0.1, "val_dice_person": 0.1}, meta={"NUM_STEPS_CURRENT_ROUND": 1})
        if task == "validate":  # the final aggregate scores best: it becomes the best global model only now
            return FLModel(params={}, metrics={"val_dice": 0.9, "val_dice_person": 0.9})
        return FLModel(params={}, metrics={"test": {"site": {"dice": 0.5}}})

    stub = Stub(ctrl, reply)
    for r in range(ctrl.n_rounds()):
        ctrl.round(r)
        ctrl.store.save(r, ctrl.checkpoint(r))
    ctrl.finish()
    tested = unprefixed("global", next(d.params for t, _, d in stub.sent if t == "test"))
    final = ctrl.store.final()
    assert final["best"]["round"] == ctrl.n_rounds()  # the final validation's choice
    assert all(torch.equal(unprefixed("best", final)[k], tested[k]) for k in tested)
    stale = ctrl.store.load(ctrl.store.latest())["best"]["round"]
    assert stale < ctrl.n_rounds()  # the last round's checkpoint alone would hand out an older model
    person = unprefixed("bestperson.site-1", final)
    assert all(torch.equal(person[k], ctrl.person["site-1"][k]) for k in person)


def test_gamma_is_chosen_on_validation_never_on_test():
    def site(val, test):
        return {"validation": {g: {"dice": v} for g, v in val.items()},
                "super": {g: {"dice": v} for g, v in test.items()}}

    infer = {"site-1": site({"0.5": 0.8, "0.9": 0.6}, {"0.5": 0.1, "0.9": 0.9}),
             "site-2": site({"0.5": 0.7, "0.9": 0.6}, {"0.5": 0.2, "0.9": 0.9}),
             "site-3": {"super": {"0.5": {"dice": 0.3}, "0.9": {"dice": 0.4}}}}  # outside: no validation vote
    out = choose_gamma(infer)
    assert out["gamma_selected"] == 0.5  # test Dice would pick 0.9
    assert out["test_at_gamma"] == {"site-1": 0.1, "site-2": 0.2, "site-3": 0.3}
    assert choose_gamma({"site-1": {"super": {"extra": {"dice": 0.5}}}}) == {}
