"""The example's modules import as the daemon imports them (`daemon.python_path`: the example's folder)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
