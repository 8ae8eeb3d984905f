"""The service's ``rlhf`` command line (``jobs/cli.py``)."""

import subprocess
import sys


def test_rlhf_train_offers_restart():
    """``rlhf train`` is the engine's command (``add_train_command``), with every option of it."""
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "train", "--help"], capture_output=True, text=True, timeout=120, check=True
    )
    assert "--restart" in proc.stdout
    assert "--out" in proc.stdout
