"""A model factory for test_process_end.py: the harness's GPT, plus a module-level object whose
finalizer writes "interpreter finalized" to stderr when the interpreter frees it at exit. A
process that ends with os._exit (harness/process/process_end.py) never frees it, so never writes it."""

import os

from harness.models.gpt import build_gpt


class _Probe:
    def __del__(self, write=os.write) -> None:  # bound now: module globals are gone by then
        write(2, b"interpreter finalized\n")


PROBE = _Probe()
build = build_gpt
