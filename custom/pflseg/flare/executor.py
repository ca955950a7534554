"""The site executor of package-mode jobs: FLARE's Client API executor running the installed client script.

A package-mode job carries no code (no ``app/custom``), so it cannot name a script file inside the job.
This executor points FLARE's in-process Client API executor at ``pflseg/flare/job_client.py`` of the pflseg
package installed at the site. Sites allow it (and the server the controllers) through the
``class_allow_list`` that provisioning writes (``pflseg.deploy.provision.AllowListBuilder``).
"""

from __future__ import annotations

from pathlib import Path

from nvflare.app_common.executors.client_api_executor import ClientAPIExecutor
from nvflare.client.config import ExchangeFormat

import pflseg.flare.job_client as _launcher


class SiteExecutor(ClientAPIExecutor):
    """``ClientAPIExecutor(in_process, task_script_path=<installed pflseg>/flare/job_client.py)``, torch tensors end
    to end."""

    def __init__(self):
        super().__init__(
            execution_mode="in_process",
            task_script_path=str(Path(_launcher.__file__).resolve()),
            params_exchange_format=ExchangeFormat.PYTORCH,
            server_expected_format=ExchangeFormat.PYTORCH,
        )
