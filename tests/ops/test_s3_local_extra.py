"""The packages of ops/s3/local_server.py are an installable extra (`s3-local`), the
README says to install it, and without them the script says so in one line instead of a
traceback."""

import ast
import subprocess
import sys
import tomllib

from procs import ENV, ROOT

SERVER = ROOT / "ops" / "s3" / "local_server.py"


def test_the_s3_local_extra_holds_every_third_party_import_of_the_server():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["s3-local"]
    names = {req.split("[")[0].split(">")[0].split("=")[0].strip() for req in extra}
    imported = {node.names[0].name.split(".")[0] if isinstance(node, ast.Import) else node.module.split(".")[0]
                for node in ast.walk(ast.parse(SERVER.read_text())) if isinstance(node, (ast.Import, ast.ImportFrom))}
    third_party = imported - set(sys.stdlib_module_names) - {"__future__", "harness"}
    assert third_party == {"boto3", "moto"} and third_party <= names
    assert "pip install -e '.[s3-local]'" in (ROOT / "README.md").read_text()


def test_without_moto_the_server_says_what_to_install():
    hide = ("import runpy, sys; sys.modules['moto'] = None; sys.argv = ['local_server.py']; "
            f"runpy.run_path({str(SERVER)!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "pip install -e '.[s3-local]'" in proc.stderr
