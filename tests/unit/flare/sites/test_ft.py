"""FT site: fine-tunes the received global model and keeps the best epoch by validation."""


def test_finetune_scores_the_global_model_and_every_epoch(federation):
    fed = federation("ft", ft={"epochs": 2})
    site = fed.site()
    assert "finetune" in site.tasks() and "infer" not in site.tasks()
    out = site.finetune(fed.message(2))
    scores = out.metrics["ft_val_dice"]
    assert len(scores) == 3 and out.metrics["ft_best_epoch"] == max(range(3), key=lambda e: (scores[e], -e))
    assert out.params == {}
