"""Centralized, the site's side: the first site by name trains on the pooled training (and validation)
data of every site of the job; each site scores the pooled model on its own test split."""

from __future__ import annotations

from pflseg.flare.sites.fedavg import FedAvgSite


class CentralizedSite(FedAvgSite):
    def pooled_sites(self) -> list[str] | None:
        return self.sites if self.name == sorted(self.sites)[0] else None
