"""The task tests start real runs of the examples (examples/), as nodes of a torchrun job too: the
launcher helpers of the distributed tests (tests/distributed/launch.py, nodes.py) are imported from
their folder."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
