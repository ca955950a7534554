"""The loop's GPU options on a CPU: mixed precision (``train.amp``), channels-last memory format, pinned memory, the
peak-memory report, and their config keys. Off (the default), they change nothing, bit for bit."""

import logging

import pytest
import torch
from monai.networks.nets import UNet
from torch.utils.data import Dataset

from pflseg.config import AMP_MODES, ConfigError, load_job_config
from pflseg.train import Hooks, build_loss, build_optimizer, evaluate, make_loader, peak_gpu_memory, train_epochs
from pflseg.train.evaluate import adabn
from pflseg.train.loop import AMP_DTYPES, _fallback_note, amp_dtype, seed_everything

CPU = torch.device("cpu")


class Discs(Dataset):
    """Noisy 32 x 32 images of a disc (the label), 4 slices per case: a task a small UNet learns in a few steps."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        yy, xx = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
        self.items = []
        for i in range(n):
            cy, cx, r = (torch.rand(3, generator=g) * torch.tensor([16.0, 16, 6]) + torch.tensor([8, 8, 4])).tolist()
            label = (((yy - cy) ** 2 + (xx - cx) ** 2) < r * r).float()[None]
            image = label + 0.5 * torch.randn(1, 32, 32, generator=g)
            self.items.append({"image": image, "label": label, "case": f"case{i // 4}", "slice": i % 4})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def unet() -> UNet:
    """A small UNet with batch norm, as pflseg's default net."""
    return UNet(2, 1, 1, (8, 16, 32), (2, 2), num_res_units=1, norm="batch")


def train(amp="off", channels_last=False, epochs=3, hooks=None, loss_fn=None):
    """A seeded UNet trained ``epochs`` passes over 32 images (4 Adam steps each); its loop stats, the model and its
    optimizer."""
    seed_everything(0)
    net = unet()
    optimizer = build_optimizer(net, CPU, 1e-2)
    stats = train_epochs(net, make_loader(Discs(32, 0), 8, shuffle=True, seed=0), optimizer,
                         loss_fn or build_loss("dice"), epochs, CPU, hooks, amp=amp, channels_last=channels_last)
    return stats, net, optimizer


class RecordingLoss(torch.nn.Module):
    """Dice, recording the dtype of the logits it gets and whether autocast was on while it ran."""

    def __init__(self):
        super().__init__()
        self.dice, self.seen = build_loss("dice"), set()

    def forward(self, logits, label):
        self.seen.add((logits.dtype, torch.is_autocast_enabled("cpu")))
        return self.dice(logits, label)


def cpu_grad_scalers(monkeypatch) -> list:
    """fp16 exists on CUDA only: a CPU stands in. ``torch.amp.GradScaler("cuda")`` then makes a CPU scaler that counts
    its scaled backward passes (``.scaled``); returns the list of the scalers made."""
    made: list = []
    real = torch.amp.GradScaler

    class Counting(real):
        scaled = 0

        def scale(self, outputs):
            self.scaled += 1
            return super().scale(outputs)

    def scaler(device):
        assert device == "cuda"  # the one the code asks for on a GPU
        made.append(Counting("cpu"))
        return made[-1]

    monkeypatch.setattr(torch.amp, "GradScaler", scaler)
    return made


class ConvDtypes:
    """The dtypes of every Conv2d output while the block runs (a global forward hook)."""

    def __enter__(self):
        self.seen = set()

        def hook(module, args, out):
            if isinstance(module, torch.nn.Conv2d):
                self.seen.add(out.dtype)

        self.handle = torch.nn.modules.module.register_module_forward_hook(hook)
        return self.seen

    def __exit__(self, *exc):
        self.handle.remove()


def test_defaults_are_the_plain_float32_loop_bit_for_bit():
    """amp off, contiguous format: the same parameters as a hand-written float32 loop (the loop before the options)."""
    _, net, _ = train(epochs=2)
    seed_everything(0)
    ref = unet()
    optimizer = torch.optim.Adam(ref.parameters(), lr=1e-2)
    loss_fn, loader = build_loss("dice"), make_loader(Discs(32, 0), 8, shuffle=True, seed=0)
    for _ in range(2):
        for batch in loader:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(ref(batch["image"]), batch["label"]).backward()
            optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), ref.state_dict().values()))


def test_bf16_autocast_trains_a_unet_to_about_the_float32_dice():
    """bf16 keeps 8 bits of mantissa (relative rounding 2^-9 ~ 0.2 %) in each convolution's output; over the Adam steps
    the two runs drift apart, and a few pixels at the disc edges flip: measured 0.005 Dice after 24 steps (0.716 vs
    0.721), 0.016 after 12 (0.528 vs 0.544). 0.05 leaves 2.5 times the worst of those and is a tenth of what the runs
    learn (Dice about 0 -> 0.72), so a forward pass or loss computed wrongly in bf16 (no learning, or learning a
    different map) does not pass; the hooks check that autocast really ran and that the loss got float32 logits."""
    extra_seen, loss_fn = set(), RecordingLoss()

    def extra(model, batch, logits):  # an extra term runs under autocast, on the logits as the forward pass made them
        extra_seen.add((logits.dtype, torch.is_autocast_enabled("cpu")))
        return torch.zeros((), device=logits.device)

    with ConvDtypes() as conv_dtypes:
        stats16, net16, _ = train("bf16", epochs=6, hooks=Hooks(extra_loss=extra), loss_fn=loss_fn)
        dice16 = evaluate(net16, Discs(16, 1), CPU, amp="bf16")["dice"]
    assert conv_dtypes == {torch.bfloat16} and extra_seen == {(torch.bfloat16, True)}
    assert loss_fn.seen == {(torch.float32, False)}  # the task loss: float32 logits, outside autocast
    stats32, net32, _ = train("off", epochs=6)
    dice32 = evaluate(net32, Discs(16, 1), CPU)["dice"]
    assert dice32 > 0.5 and abs(dice16 - dice32) < 0.05
    assert abs(stats16["loss"] - stats32["loss"]) < 0.01
    assert all(p.dtype == torch.float32 for p in net16.parameters())  # autocast casts copies; weights stay float32


def test_the_loss_is_computed_in_float32_outside_autocast_also_in_a_custom_step():
    seen = {}

    def step(model, batch, optimizer, loss_fn):
        seen["autocast"] = torch.is_autocast_enabled("cpu")
        optimizer.zero_grad(set_to_none=True)
        logits = model(batch["image"])
        loss = loss_fn(logits, batch["label"])
        seen["logits"], seen["loss"] = logits.dtype, loss.dtype
        loss.backward()
        optimizer.step()
        return float(loss)

    stats, _, _ = train("bf16", epochs=1, hooks=Hooks(step=step))
    assert seen == {"autocast": True, "logits": torch.bfloat16, "loss": torch.float32} and stats["steps"] == 4


def test_fp16_on_a_cpu_computes_in_float32_with_a_log_line(caplog):
    _fallback_note.cache_clear()
    with caplog.at_level(logging.WARNING, logger="pflseg.train"), ConvDtypes() as conv_dtypes:
        _, net16, _ = train("fp16", epochs=1)
    assert conv_dtypes == {torch.float32} and "train.amp=fp16" in caplog.text and "float32" in caplog.text
    _, net32, _ = train("off", epochs=1)
    assert all(torch.equal(a, b) for a, b in zip(net16.state_dict().values(), net32.state_dict().values()))


def test_fp16_is_refused_for_a_custom_step_on_every_device():
    with pytest.raises(ConfigError, match="train.amp=fp16.*bf16"):
        train("fp16", epochs=1, hooks=Hooks(step=lambda *a: 0.0))


@pytest.mark.parametrize("amp, device, expected", [
    ("off", "cpu", None), ("bf16", "cpu", torch.bfloat16), ("fp16", "cpu", None), ("bf16", "meta", None),
])
def test_amp_dtype_per_device(amp, device, expected):
    assert amp_dtype(amp, device) is expected


def test_unknown_amp_is_a_config_error_and_the_modes_match_the_config():
    assert list(AMP_DTYPES) == list(AMP_MODES) == ["off", "bf16", "fp16"]
    with pytest.raises(ConfigError, match="train.amp"):
        amp_dtype("fp8", CPU)


def test_channels_last_gives_the_same_outputs_and_leaves_the_model_contiguous():
    """The same arithmetic in another memory layout; the CPU's convolution kernels for it may sum in another order,
    so outputs agree to float32 rounding (1e-5 on values of order 1), not bit for bit."""
    seed_everything(0)
    net = unet().eval()
    x = Discs(8, 2)
    images = torch.stack([x[i]["image"] for i in range(8)])
    with torch.no_grad():
        plain = net(images)
        net.to(memory_format=torch.channels_last)
        last = net(images.contiguous(memory_format=torch.channels_last))
    assert torch.allclose(plain, last, rtol=1e-4, atol=1e-5)
    stats_cl, net_cl, optimizer = train("off", channels_last=True, epochs=2)
    stats, net_plain, _ = train("off", epochs=2)
    assert abs(stats_cl["loss"] - stats["loss"]) < 1e-4
    # The trained models agree, with batch statistics (train mode), not their parameters: a convolution's bias before
    # batch norm has a gradient of rounding noise only, which Adam turns into steps of +-lr, so those biases (and the
    # running means that track them) differ while the function does not. Measured: 2e-5 on logits up to 8.
    with torch.no_grad():
        assert torch.allclose(net_cl.train()(images), net_plain.train()(images), rtol=1e-4, atol=1e-4)
    assert all(p.is_contiguous() for p in net_cl.parameters())  # back in the contiguous format after the loop
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in net_cl.parameters()}  # the same parameters: the optimizer still holds them
    scored = evaluate(net_cl, Discs(16, 1), CPU, channels_last=True)
    assert scored["dice"] == pytest.approx(evaluate(net_plain, Discs(16, 1), CPU)["dice"], abs=0.02)


def test_evaluation_and_adabn_with_amp_keep_float32_state():
    _, net, _ = train("off", epochs=1)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with ConvDtypes() as conv_dtypes:
        out = evaluate(net, Discs(16, 1), CPU, amp="bf16", channels_last=True)
        adabn(net, make_loader(Discs(16, 1), 8, shuffle=False), CPU, amp="bf16", channels_last=True)
    assert conv_dtypes == {torch.bfloat16} and 0.0 <= out["dice"] <= 1.0
    after = net.state_dict()
    assert all(after[k].dtype == before[k].dtype for k in before)
    assert not torch.equal(after["model.0.conv.unit0.adn.N.running_mean"],
                           before["model.0.conv.unit0.adn.N.running_mean"])  # re-estimated


def test_pinned_memory_for_cuda_only_and_no_peak_memory_on_a_cpu():
    assert make_loader(Discs(4, 0), 2, shuffle=False, device="cuda").pin_memory is True  # built, not iterated
    assert make_loader(Discs(4, 0), 2, shuffle=False, device=CPU).pin_memory is False
    assert make_loader(Discs(4, 0), 2, shuffle=False).pin_memory is False
    assert peak_gpu_memory(CPU) is None
    stats, _, _ = train("off", epochs=1)
    assert stats["peak_gpu_bytes"] is None and set(stats) == {"loss", "steps", "samples", "peak_gpu_bytes"}


def test_config_keys_default_off_and_are_checked():
    train_cfg = load_job_config("fedavg")["train"]
    assert train_cfg["amp"] == "off" and train_cfg["channels_last"] is False
    assert load_job_config("fedavg", overrides={"train": {"amp": False}})["train"]["amp"] == "off"  # YAML's bare off
    assert load_job_config("fedavg", overrides={"train": {"amp": "bf16", "channels_last": True}})["train"] == {
        **train_cfg, "amp": "bf16", "channels_last": True}
    with pytest.raises(ConfigError, match=r"train.amp must be one of off, bf16, fp16.*got True"):
        load_job_config("fedavg", overrides={"train": {"amp": True}})  # YAML's bare on
    with pytest.raises(ConfigError, match=r"train.amp must be one of off, bf16, fp16.*got 'fp32'"):
        load_job_config("fedavg", overrides={"train": {"amp": "fp32"}})
    with pytest.raises(ConfigError, match="train.channels_last"):
        load_job_config("fedavg", overrides={"train": {"channels_last": "yes"}})
