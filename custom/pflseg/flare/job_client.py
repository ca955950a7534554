"""The launcher of the one Client API script, ``pflseg.flare.client``: BYOC jobs carry it as
app/custom/job_client.py next to their copy of pflseg, package-mode sites run it from the installed pflseg
(``pflseg.flare.executor.SiteExecutor``). A BYOC job runs the pflseg it carries even where another pflseg
is installed (FLARE itself puts app/custom last on the import path). It logs where pflseg came from."""

import logging
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
if (_HERE / "pflseg" / "__init__.py").is_file() and "pflseg" not in sys.modules:
    sys.path.insert(0, str(_HERE))  # BYOC: the job's own code first

import pflseg  # noqa: E402
from pflseg.flare.client import main  # noqa: E402

if __name__ == "__main__":
    logging.getLogger("pflseg.client").info("pflseg from %s", Path(pflseg.__file__).resolve().parent)
    main()
