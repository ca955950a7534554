"""The `python job.py` route's own script: --help answers before anything heavy is imported, and --export (FLARE's
flag, which FLARE takes out of sys.argv at import) writes the job without FLARE's warning about it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_help_is_answered_before_torch_or_flare_is_imported():
    code = ("import sys, runpy\nsys.argv = ['job.py', '--help']\ntry:\n"
            "    runpy.run_path('job.py', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('heavy:', sorted(m for m in ('torch', 'nvflare', 'monai') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    assert "--export-dir" in out and "heavy: []" in out


def test_export_writes_the_job_without_flares_warning(tmp_path):
    proc = subprocess.run([sys.executable, "job.py", "fedavg", "--export", "--export-dir", str(tmp_path / "job")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "UserWarning" not in proc.stderr and "NVFlare reserves" not in proc.stderr
    assert f"Job exported to: {tmp_path / 'job'}" in proc.stdout and (tmp_path / "job").is_dir()
