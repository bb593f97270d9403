"""The distributed tests import their launcher helpers (launch.py) from this folder."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
