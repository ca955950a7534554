"""Centralized, the site's side: the first site by name trains on the pooled training (and validation)
data of every site of the job; each site scores the pooled model on its own test split. Reading the other
sites' folders of its data root is the site's decision (``policy.pooling``, ``pflseg.flare.policy.check_pooling``:
by default in the simulator only), never the job's."""

from __future__ import annotations

from pflseg.flare.policy import check_pooling
from pflseg.flare.sites.fedavg import FedAvgSite


class CentralizedSite(FedAvgSite):
    def __init__(self, name: str, cfg: dict, sites: list[str], job_id: str | None = None):
        self.job_id = job_id  # pooled_sites (called while the site is made) asks the policy about this job
        super().__init__(name, cfg, sites, job_id)

    def pooled_sites(self) -> list[str] | None:
        if self.name != sorted(self.sites)[0]:
            return None
        own = {self.name, self.settings.get("data_site") or self.name}
        check_pooling(self.name, [s for s in self.sites if s not in own], self.settings, self.job_id)
        return self.sites
