"""The command line is one package: argparse only in harness/cli/, the library never imports it,
and importing it does not import torch (numerics.prepare_environment must run first)."""

import ast
import subprocess
import sys
from pathlib import Path

HARNESS = Path(__file__).resolve().parents[2] / "harness"


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_argparse_only_in_the_cli_package():
    outside = [str(p.relative_to(HARNESS)) for p in HARNESS.rglob("*.py")
               if "argparse" in imported_modules(p) and p.parent.name != "cli"]
    assert outside == []


def test_the_library_does_not_import_the_cli():
    probe = ("import sys, harness.testing, harness.verify.resume_equivalence, harness.experiments.arms, "
             "harness.experiments.comparison, harness.run.session; "
             "print(sorted(m for m in sys.modules if m == 'harness.cli' or m.startswith('harness.cli.')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_cli_is_imported_before_torch():
    probe = "import sys, harness.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_python_dash_m_harness_runs_the_cli():
    proc = subprocess.run([sys.executable, "-m", "harness", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "verify-resume" in proc.stdout


def test_each_command_module_registers_the_command_its_name_names():
    """What lets a command line import its command's module alone (harness.cli._command_module)."""
    import argparse
    import importlib

    from harness.cli import COMMAND_MODULES, _command_module

    for module in COMMAND_MODULES:
        commands = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).register(commands)
        (command,) = commands.choices
        assert _command_module(["--log-level", "debug", command, "x"]) == module


def test_status_and_report_start_without_torch(tmp_path):
    """A run's screen is read without importing torch (seconds of CPU on a busy machine)."""
    probe = ("import sys; from harness.cli import main; code = main(sys.argv[1:]); "
             "print('torch' in sys.modules, code, file=sys.stderr)")
    for command in ("status", "report"):
        proc = subprocess.run([sys.executable, "-c", probe, command, str(tmp_path)], capture_output=True, text=True)
        assert proc.stderr.strip().endswith("False 2"), proc.stderr
