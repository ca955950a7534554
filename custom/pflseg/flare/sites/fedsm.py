"""FedSM (Xu et al., CVPR 2022), the site's side.

Training (task ``train``): site k receives the global model, its own personalized model only, the selector
and its selector label k; it trains the global and personalized models with the one loop, scores the
RECEIVED selector on its validation split (accuracy ``selector_val_acc`` and the summed NLL at every
temperature, ``selector_val_nll``: the server keeps the best selector and fits its temperature from these),
and sends what the selector's fit needs (``fedsm.selector_fit`` / ``selector_steps``, see
``pflseg.algorithms.fedsm``):

    lda            ``stats.gram`` / ``stats.sum`` / ``stats.count`` of its training images' selector features
    softmax epoch  ``grad.<param>``: the gradient of its summed cross-entropy at the received selector
    softmax batch  the selector after ``selector_epochs`` epochs of per-batch Adam (``select.``) and its Adam
                   moments (``moment.``; the server's average arrives with the selector)

The selector sees ``selector_view`` of each batch (``fedsm.selector_input``). FedSM-extra (task
``train_selector``): each training sample is labelled with the candidate model of lowest segmentation loss
on it (0 = global, k + 1 = personalized model of site k) and the (K+1)-class selector is fitted the same way.
Inference (job ``fedsm_infer``, ``FedSMInferenceSite``, task ``infer``): the super model routes every test
image (``pflseg.infer.fedsm``) with the bundle's selector, input rule and temperature. With the familiarity
fallback (``fedsm.familiar_fallback``) the message also carries the selector features' class means and shared
precision (``familiar.mean`` / ``familiar.precision``): an inside site then also sends its validation images'
d2_min (``validation_d2_min``, one scalar per image: the server sets the threshold tau from them); an outside
site, which receives tau (meta ``familiar_tau``), sends the super model with the fallback (``super``) and
without it (``super_nofallback``) and how many of its images fell back (``fallback``).

Mixed precision (``train.amp``, ``pflseg.train.loop``): besides the segmentation models' training and evaluation
(the loop's), every forward pass of the selector (scoring, its features, its fit) and of FedSM-extra's candidate models
runs under autocast on the site's device, its output cast to float32 before the softmax, the cross-entropy, the
segmentation loss and the statistics (``pflseg.train.evaluate.amp_forward``); the super model's inference too
(``pflseg.infer.fedsm``). The selector's per-batch Adam steps (softmax, batch) scale their backward pass with a
``torch.amp.GradScaler`` under fp16 (on CUDA; a new one per round, as the loop's). The epoch-mode gradient is sent
as it is, with no optimizer step to skip where a scaled gradient overflowed: fp16 with ``selector_fit: softmax``,
``selector_steps: epoch`` is refused when the config is checked (``FedSMSection.check_amp``: at build, at the
server and at a site's first message). Off (the default) changes nothing.
"""

from __future__ import annotations

import torch
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.algorithms.fedsm import (
    TEMPERATURES,
    add_statistics,
    class_statistics,
    flatten_optimizer_state,
    nll_at_temperatures,
    selector_gradient,
    selector_labels_extra,
    selector_labels_fedsm,
    selector_view,
    unflatten_optimizer_state,
)
from pflseg.data import load_dataset_info
from pflseg.flare.outbox import Outgoing
from pflseg.flare.sites.base import Site, Step, cpu_state, trained_metrics
from pflseg.flare.wire import FAMILIAR, GLOBAL, GRAD, MOMENT, PERSON, SELECT, STATS, prefixed, split_by_site, unprefixed
from pflseg.infer.fedsm import evaluate_super_model
from pflseg.nets import build_net
from pflseg.nets.selector import build_selector, selector_cfg
from pflseg.train import Hooks, build_loss, build_optimizer, make_loader, train_epochs
from pflseg.train.evaluate import amp_forward
from pflseg.train.loop import amp_dtype, backward_step


class _AmpSelector:
    """``selector`` for ``selector_gradient``: its calls through ``amp_forward`` in ``dtype``, every other attribute
    (``zero_grad``, ``named_parameters``) the selector's own."""

    def __init__(self, selector: torch.nn.Module, dtype: torch.dtype):
        self.selector, self.dtype = selector, dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return amp_forward(self.selector, x, self.dtype)

    def __getattr__(self, name: str):
        return getattr(self.selector, name)


class FedSMSite(Site):
    @classmethod
    def personal_models_sent(cls, cfg: dict) -> str | None:
        return "FedSM's personalized model every round (SoftPull mixes it into every other site's)"

    def tasks(self) -> dict:
        return {**super().tasks(), "train_selector": self.train_selector}

    def personalized_model(self, received: dict) -> torch.nn.Module:
        person = build_net(self.cfg["net"])
        person.load_state_dict(unprefixed(PERSON, received))
        return person

    def step(self, received: FLModel, prev: dict, seed: int) -> Step:
        """Train the global model and this site's personalized model; score the received selector and send this
        site's part of its fit (label k); keep both models' optimizer states."""
        r, params = received.current_round, received.params
        person = self.personalized_model(params)
        val_p = self.track(person, r)  # the site's own best model is its personalized one
        glob = self.model_for_round(params, prev)
        val_g = self.evaluate(glob)
        with self.training_time():
            stats, optim_g = self.fit(glob, "global", prev, seed)
            _, optim_p = self.fit(person, "person", prev, seed)
            labels_of = self.site_labels(int(received.meta["selector_label"]))
            # the federation's selector, as used at inference
            selector = self.received_selector(params, len(self.sites))
            scored = self.score_selector(selector, labels_of)  # before it is fitted on: the received one
            sel_params, sel_metrics = self.fit_selector(selector, labels_of, received, seed)
        send = {**prefixed(GLOBAL, cpu_state(glob)), **prefixed(PERSON, cpu_state(person)), **sel_params}
        metrics = trained_metrics({"val_dice": val_g["dice"], "val_dice_person": val_p["dice"]}, stats,
                                  {**scored, **sel_metrics})
        return Step(send, {"optim.global": optim_g, "optim.person": optim_p}, metrics, stats["samples"])

    def autocast_dtype(self) -> torch.dtype | None:
        """The autocast dtype of ``train.amp`` on the site's device (``pflseg.train.loop.amp_dtype``)."""
        return amp_dtype(self.cfg["train"]["amp"], self.device)

    def site_labels(self, label: int):
        """FedSM's selector labels of a batch of this site: ``label`` (its index k) for every sample."""
        return lambda batch: selector_labels_fedsm(label, batch["image"].shape[0], len(self.sites))

    def received_selector(self, params: dict, classes: int) -> torch.nn.Module:
        selector = build_selector(selector_cfg(self.cfg, classes))
        selector.load_state_dict(unprefixed(SELECT, params))
        return selector.to(self.device)

    def selector_input(self, batch: dict) -> torch.Tensor:
        """What the selector sees of ``batch`` (``fedsm.selector_input``, ``pflseg.algorithms.fedsm.selector_view``)."""
        return selector_view(batch["image"], batch.get("intensity"), self.cfg["fedsm"]["selector_input"])

    def batches(self, split: str):
        """The site's ``split`` in order, in batches of ``train.eval_batch_size``, on the site's device."""
        for batch in make_loader(self.data(split), self.cfg["train"]["eval_batch_size"], shuffle=False):
            yield {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    @torch.no_grad()
    def score_selector(self, selector, labels_of, local: bool = False) -> dict:
        """``selector`` on the site's validation split: ``selector_val_acc``, the fraction of images it sends to
        their label's model, and ``selector_val_nll``, the summed NLL at every temperature of ``TEMPERATURES``
        (the server adds the sites' sums and fits the temperature of the selector it keeps). Reported for the
        received (aggregated) selector, the one inference uses; with per-batch steps also the accuracy of the
        locally trained one (``local``: ``selector_val_acc_local``; with one label per site it is trivially
        high, so it says nothing about routing)."""
        selector.to(self.device).eval()
        dtype = self.autocast_dtype()
        right, total, nll = 0, 0, torch.zeros(len(TEMPERATURES), dtype=torch.float64)
        for batch in self.batches("validation"):
            logits = amp_forward(selector, self.selector_input(batch), dtype).float().cpu()
            labels = labels_of(batch).cpu()
            right += int((logits.argmax(1) == labels).sum())
            total += labels.shape[0]
            nll += nll_at_temperatures(logits, labels)
        if local:
            return {"selector_val_acc_local": right / max(total, 1)}
        return {"selector_val_acc": right / max(total, 1), "selector_val_nll": [float(v) for v in nll]}

    def fit_selector(self, selector, labels_of, msg: FLModel, seed: int) -> tuple[dict, dict]:
        """What this site contributes to the selector's fit (``fedsm.selector_fit`` / ``selector_steps``, see the
        module docstring): ``(params to send, metrics)``; ``selector`` is the received one (trained in place in
        batch mode). ``selector_loss`` is the mean cross-entropy on the training images: of the received
        selector (lda, epoch) or the mean batch loss of local training (batch)."""
        fedsm = self.cfg["fedsm"]
        if fedsm["selector_fit"] == "lda":
            return self.selector_statistics(selector, labels_of)
        if fedsm["selector_steps"] == "epoch":
            selector.train()
            dtype = self.autocast_dtype()
            pairs = ((self.selector_input(b), labels_of(b)) for b in self.batches("training"))
            grads, loss = selector_gradient(selector if dtype is None else _AmpSelector(selector, dtype), pairs)
            return prefixed(GRAD, grads), {"selector_loss": loss / len(self.data("training"))}
        return self.train_selector_batches(selector, labels_of, msg, seed)

    @torch.no_grad()
    def selector_statistics(self, selector, labels_of) -> tuple[dict, dict]:
        """lda: ``class_statistics`` of the selector's features (``Selector.embed``) of the training images."""
        selector.eval()
        dtype = self.autocast_dtype()
        classes = selector.classifier.out_features
        stats, ce, n = [], 0.0, 0
        for batch in self.batches("training"):
            features, labels = amp_forward(selector.embed, self.selector_input(batch), dtype), labels_of(batch)
            stats.append(class_statistics(features, labels, classes))
            logits = amp_forward(selector.classifier, features, dtype)
            ce += float(torch.nn.functional.cross_entropy(logits, labels.to(features.device), reduction="sum"))
            n += labels.shape[0]
        return prefixed(STATS, add_statistics(stats)), {"selector_loss": ce / max(n, 1)}

    def train_selector_batches(self, selector, labels_of, msg: FLModel, seed: int) -> tuple[dict, dict]:
        """softmax, batch (paper): ``fedsm.selector_epochs`` epochs of per-batch Adam on cross-entropy against
        ``labels_of(batch)``, Adam moments from the server's average; returns the selector and its moments. Under
        ``train.amp`` the forward pass runs under autocast, the cross-entropy in float32, and with fp16 (CUDA) the
        backward pass is scaled by a ``GradScaler`` (module docstring)."""
        cfg = self.cfg
        dtype = self.autocast_dtype()
        scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None
        moments = unprefixed(MOMENT, msg.params)
        optimizer = build_optimizer(selector, self.device, cfg["fedsm"]["selector_lr"])
        if moments:
            optimizer.load_state_dict(unflatten_optimizer_state(moments, optimizer.state_dict()["param_groups"]))
        ce = torch.nn.CrossEntropyLoss()

        def step(model, batch, opt, _):
            opt.zero_grad(set_to_none=True)
            loss = ce(amp_forward(model, self.selector_input(batch), dtype), labels_of(batch).to(batch["image"].device))
            backward_step(loss, opt, scaler)
            return float(loss.detach())

        loader = make_loader(self.data("training"), cfg["train"]["batch_size"], shuffle=True, seed=seed)
        stats = train_epochs(selector, loader, optimizer, None, cfg["fedsm"]["selector_epochs"], self.device,
                             Hooks(step=step))
        local = self.score_selector(selector, labels_of, local=True)
        moments = flatten_optimizer_state(optimizer.state_dict())
        params = {**prefixed(SELECT, cpu_state(selector)), **prefixed(MOMENT, moments)}
        return params, {"selector_loss": stats["loss"], **local}

    def train_selector(self, msg: FLModel) -> Outgoing:
        """Task ``train_selector`` (FedSM-extra): the round skeleton, outside the rounds' state, with
        ``selector_step``."""
        return self.run_round(msg, self.selector_step, state=False)

    def selector_step(self, received: FLModel, prev: dict, seed: int) -> Step:
        """FedSM-extra round: label each training sample with the candidate model (0 = global, k + 1 =
        personalized model of site k) of lowest segmentation loss on it, and train the (K+1)-class selector."""
        candidates = []  # 0 = global, k + 1 = personalized model of site k
        sent = received.params
        for state in [unprefixed(GLOBAL, sent), *split_by_site(PERSON, sent, self.sites).values()]:
            net = build_net(self.cfg["net"])
            net.load_state_dict(state)
            candidates.append(net.to(self.device).eval())
        dtype = self.autocast_dtype()
        per_sample = build_loss(self.cfg["train"]["loss"], reduction="none")

        @torch.no_grad()
        def labels_of(batch):
            losses = [per_sample(amp_forward(m, batch["image"], dtype), batch["label"]).flatten(1).mean(1)
                      for m in candidates]
            return selector_labels_extra(torch.stack(losses, dim=1).cpu())

        with self.training_time():
            selector = self.received_selector(received.params, len(self.sites) + 1)
            scored = self.score_selector(selector, labels_of)
            params, sel_metrics = self.fit_selector(selector, labels_of, received, seed)
        return Step(params, {}, {**scored, **sel_metrics}, len(self.data("training")))

    def validate(self, msg: FLModel) -> Outgoing:
        """The global model scored for the server's choice; the personalized model tracked as the site's own; the
        final selector, when sent (FedSM's K-class one: labels are the site's index in the federation's site
        order, as in training), scored as in a round (a candidate for the server's best selector)."""
        val = self.evaluate(self.model_for_round(msg.params, {}))
        val_p = self.track(self.personalized_model(msg.params), msg.current_round)
        metrics = {"val_dice": val["dice"], "val_dice_person": val_p["dice"]}
        if unprefixed(SELECT, msg.params):
            selector = self.received_selector(msg.params, len(self.sites))
            metrics.update(self.score_selector(selector, self.site_labels(self.sites.index(self.name))))
        return self.reply({}, metrics)


class FedSMInferenceSite(Site):
    """The FedSM super model at this site (inside or outside the federation)."""

    def tasks(self) -> dict:
        return {"infer": self.infer}

    def infer(self, msg: FLModel) -> Outgoing:
        """Route every test image through the selector, score global / own personalized / super model for
        every gamma, write predictions."""
        inside = list(msg.meta["inside_sites"])
        models = []
        for state in [unprefixed(GLOBAL, msg.params), *split_by_site(PERSON, msg.params, inside).values()]:
            net = build_net(self.cfg["net"])
            net.load_state_dict(state)
            models.append(net)
        select = unprefixed(SELECT, msg.params)
        classes = [v for v in select.values() if v.ndim == 2][-1].shape[0]  # the head's output size
        extra = classes == len(inside) + 1
        # the trained run's selector form (its weights tell), input rule and temperature (a bundle without them:
        # z-scored input, T = 1)
        head = "linear" if "classifier.weight" in select else "mlp"
        selector = build_selector(selector_cfg(self.cfg, classes, head=head))
        selector.load_state_dict(select)
        fedsm, own = self.cfg["fedsm"], inside.index(self.name) if self.name in inside else None
        common = dict(gammas=fedsm["gammas"], own_index=own, extra=extra,
                      batch_size=self.cfg["train"]["eval_batch_size"],
                      selector_input=msg.meta.get("selector_input", "zscore"),
                      temperature=float(msg.meta.get("selector_temperature", 1.0)), amp=self.cfg["train"]["amp"],
                      mixing=fedsm["mixing"])
        familiarity = unprefixed(FAMILIAR, msg.params) or None
        tau = msg.meta.get("familiar_tau")
        fallback = dict(familiarity=familiarity, familiar_tau=float(tau)) if familiarity and tau is not None else {}
        data = self.data("testing") if own is not None else self.all_images()  # an outside site: every image
        result = evaluate_super_model(
            models[0], models[1:], selector, data, self.device, **common, **fallback,
            out_dir=self.store.root / "predictions", save_gamma=fedsm["gamma"],
            label_encoding=load_dataset_info(self.root)["label_encoding"])
        result.pop("d2_min", None)  # per-image distances of test images stay here; counts leave (``fallback``)
        result["inside"] = own is not None
        if own is not None:  # inside sites score every gamma on validation: the server chooses gamma there
            val = evaluate_super_model(models[0], models[1:], selector, self.data("validation"), self.device, **common,
                                       familiarity=familiarity)
            result["validation"] = {route: {"dice": v["dice"], "selection": v["selection"], "selected": v["selected"]}
                                    for route, v in val["super"].items()}
            if familiarity:  # the server's threshold for the outside sites comes from these
                result["validation_d2_min"] = val["d2_min"]
        return self.reply({}, {"infer": result})
