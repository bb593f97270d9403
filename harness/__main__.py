"""`python -m harness ...`: the `harness` command."""

import sys

from harness.cli import main

sys.exit(main())
