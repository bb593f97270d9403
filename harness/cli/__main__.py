"""`python -m harness.cli ...`: what the `harness` script runs (child processes use this form)."""

import sys

from harness.cli import main

sys.exit(main())
