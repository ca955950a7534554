"""Cost of IOP-FL test-time routing per image, next to one forward pass of a single UNet.

    pflseg report iopfl-cost --sizes 64 256 --experts 5 --batch 8 --epochs 10

For each image size, measured side by side in one process on the same random batch: one forward pass
of the project's UNet (eval, no gradient), one forward pass of the routed model (K + 1 experts,
per-sample routers, one grouped convolution per layer) and one routing step (the unsupervised loss:
two forward passes, backward, Adam), interleaved, each the minimum over ``--repeats`` rounds. Routing an image
costs ``epochs`` steps (default 10): the report gives seconds per sample and the ratio to the single UNet's forward
pass.
"""

from __future__ import annotations

from json import dumps
from pathlib import Path

import torch

from pflseg.algorithms.routing import build_routed_model, loss_weights, router_parameters, unsupervised_loss
from pflseg.deploy.sampling import best_seconds
from pflseg.markdown import markdown_table
from pflseg.nets import build_net


def measure(size: int, n_experts: int = 5, batch: int = 8, epochs: int = 10, repeats: int = 3,
            net_cfg: dict | None = None) -> dict:
    torch.manual_seed(0)
    cfg = net_cfg or {"channels": [16, 32, 64, 128], "strides": [2, 2, 2], "num_res_units": 1, "norm": "batch"}
    experts = [build_net(cfg) for _ in range(n_experts)]
    single = experts[0].eval()
    routed = build_routed_model(experts)
    opt = torch.optim.Adam(router_parameters(routed), lr=1e-3)
    x = torch.randn(batch, 1, size, size)
    weights = loss_weights("paper")

    def forward_single():
        with torch.no_grad():
            single(x)

    def forward_routed():
        with torch.no_grad():
            routed(x)

    def step():
        opt.zero_grad(set_to_none=True)
        loss, _ = unsupervised_loss(routed, x, weights)
        loss.mean().backward()
        opt.step()

    t = best_seconds({"single": forward_single, "routed": forward_routed, "step": step}, repeats)
    single_s, routed_s, step_s = t["single"] / batch, t["routed"] / batch, t["step"] / batch
    return {"size": size, "experts": n_experts, "batch": batch, "epochs": epochs, "threads": torch.get_num_threads(),
            "unet_forward_s_per_sample": single_s, "routed_forward_s_per_sample": routed_s,
            "routing_step_s_per_sample": step_s, "routing_s_per_image": epochs * step_s,
            "ratio_routed_forward_to_unet": routed_s / single_s, "ratio_step_to_unet": step_s / single_s,
            "ratio_routing_to_unet": epochs * step_s / single_s}


def to_markdown(rows: list[dict]) -> str:
    head = ["size", "UNet forward s/sample", "routed forward s/sample", "routing step s/sample",
            "routing s/image (E epochs)",
            "routed fwd / UNet", "step / UNet", "routing / UNet"]
    return markdown_table(head, [[r["size"], f"{r['unet_forward_s_per_sample']:.4f}",
                                  f"{r['routed_forward_s_per_sample']:.4f}",
                                  f"{r['routing_step_s_per_sample']:.4f}",
                                  f"{r['routing_s_per_image']:.3f} (E={r['epochs']})",
                                  f"{r['ratio_routed_forward_to_unet']:.1f}", f"{r['ratio_step_to_unet']:.1f}",
                                  f"{r['ratio_routing_to_unet']:.0f}"] for r in rows])


def report(sizes=(64, 256), experts: int = 5, batch: int = 8, epochs: int = 10, repeats: int = 5,
           json: str | Path | None = None, **_) -> str:
    """``pflseg report iopfl-cost``: ``measure`` at each of ``sizes``; its Markdown, and the rows as JSON in the file
    ``json`` when given. Other keywords (the flags of other reports) are ignored."""
    rows = [measure(size, experts, batch, epochs, repeats) for size in sizes]
    if json:
        Path(json).write_text(dumps(rows, indent=1))
    return to_markdown(rows)
