"""Result tables: per-site test Dice of each method's model for that site (the inside protocol)."""

from __future__ import annotations

GLOBAL_METHODS = ("fedavg", "fedprox", "centralized")
LABELS = {"local": "Local", "fedavg": "FedAvg", "fedprox": "FedProx", "fedbn": "FedBN", "centralized": "Centralized"}


def site_dice(results: dict) -> dict[str, float]:
    """Per-site test Dice of the model the method gives each site: the selected global model for global
    methods, the site's own best-by-validation model otherwise."""
    key = "global" if results["method"] in GLOBAL_METHODS else "site"
    return {site: metrics[key]["dice"] for site, metrics in sorted(results["test"].items())}


def dice_table(all_results: dict[str, dict]) -> str:
    """Markdown table: one row per site (plus the mean), one column per job."""
    columns = {name: site_dice(res) for name, res in all_results.items()}
    sites = sorted({s for col in columns.values() for s in col})
    names = list(columns)
    head = "| site | " + " | ".join(LABELS.get(all_results[n]["method"], n) for n in names) + " |"
    lines = [head, "|" + "---|" * (len(names) + 1)]
    for site in sites:
        cells = [f"{columns[n][site]:.4f}" if site in columns[n] else "-" for n in names]
        lines.append(f"| {site} | " + " | ".join(cells) + " |")
    means = [sum(columns[n].values()) / max(len(columns[n]), 1) for n in names]
    lines.append("| mean | " + " | ".join(f"{m:.4f}" for m in means) + " |")
    return "\n".join(lines)
