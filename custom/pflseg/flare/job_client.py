"""The BYOC door to pflseg's site side: BYOC jobs carry this file as app/custom/job_client.py next to their copy
of pflseg and name ``job_client.SiteExecutor`` (``pflseg.flare.executor.SiteExecutor``) as their site executor.
Importing it puts app/custom first on the import path, so a BYOC job runs the pflseg it carries even where another
pflseg is installed (FLARE itself puts app/custom last). Run as a script, it is the launcher of the Client API
script ``pflseg.flare.client.main`` (``site.executor: client_api``; package-mode sites run it from the installed
pflseg: ``pflseg.flare.executor.ClientAPISiteExecutor``) and logs where pflseg came from."""

import logging
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
if (_HERE / "pflseg" / "__init__.py").is_file() and "pflseg" not in sys.modules:
    sys.path.insert(0, str(_HERE))  # BYOC: the job's own code first

import pflseg  # noqa: E402
from pflseg.flare import executor as _executor  # noqa: E402
from pflseg.flare.client import main  # noqa: E402


class SiteExecutor(_executor.SiteExecutor):
    """``pflseg.flare.executor.SiteExecutor`` of the job's own pflseg (BYOC jobs name it by this module)."""


if __name__ == "__main__":
    logging.getLogger("pflseg.client").info("pflseg from %s", Path(pflseg.__file__).resolve().parent)
    main()
