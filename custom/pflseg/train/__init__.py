from pflseg.train.evaluate import evaluate
from pflseg.train.loop import (
    Hooks,
    build_optimizer,
    derive_seed,
    make_loader,
    peak_gpu_memory,
    pick_device,
    seed_everything,
    train_epochs,
)
from pflseg.train.losses import build_loss

__all__ = ["Hooks", "build_loss", "build_optimizer", "derive_seed", "evaluate", "make_loader", "peak_gpu_memory",
           "pick_device", "seed_everything", "train_epochs"]
