"""Arrows downward only: no import circle among the modules of starpu_llm/ and experiments/
(tools/import_graph.py, which reads the sources with ast and counts the imports inside
functions too)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "import_graph.py")


def test_the_tool_finds_a_circle(tmp_path):
    """The check can fail: a package whose two modules import each other is reported."""
    pkg = tmp_path / "starpu_llm"
    (pkg / "sub").mkdir(parents=True)
    (tmp_path / "experiments").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import g\n")
    (tmp_path / "experiments" / "x.py").write_text("import y\n")
    (tmp_path / "experiments" / "y.py").write_text("from starpu_llm import a\n")
    p = subprocess.run([sys.executable, TOOL, str(tmp_path)], capture_output=True, text=True)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "starpu_llm.a, starpu_llm.sub.b" in p.stdout, p.stdout
    assert "x" not in p.stdout.split("circle among")[1].split(":")[0], p.stdout


def test_no_import_circle():
    p = subprocess.run([sys.executable, TOOL, ROOT], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
