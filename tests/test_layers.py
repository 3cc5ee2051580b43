"""Arrows downward only: no import circle among the modules of starpu_llm/ and experiments/, every
arrow down the layer order (tools/import_graph.py LAYERS), the root down to the entry points,
meson installing every module (tools/import_graph.py reads the sources with ast and counts the
imports inside functions too)."""
import os
import re
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


def _tree(tmp_path, files):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "experiments").mkdir(exist_ok=True)


def test_the_tool_finds_an_arrow_up(tmp_path):
    """The check can fail: a module of a low layer (model/) that imports one of a higher layer
    (training/), even inside a function, and a root module placed in no layer, are reported."""
    _tree(tmp_path, {"starpu_llm/__init__.py": "", "starpu_llm/model/__init__.py": "",
                     "starpu_llm/training/__init__.py": "",
                     "starpu_llm/model/config.py": "def f():\n    from ..training import trainer\n",
                     "starpu_llm/training/trainer.py": "from ..model.config import f\n",
                     "starpu_llm/loose.py": "from .model import config\n"})
    p = subprocess.run([sys.executable, TOOL, str(tmp_path)], capture_output=True, text=True)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "arrow up: starpu_llm.model.config (model) -> starpu_llm.training.trainer (training)" \
        in p.stdout, p.stdout
    assert "starpu_llm.loose is in no layer" in p.stdout, p.stdout
    assert "arrow up: starpu_llm.training.trainer" not in p.stdout, p.stdout   # down is fine


def test_every_arrow_goes_down_the_layers():
    """tools/import_graph.py's LAYERS (lowest first) is the one statement of the order."""
    p = subprocess.run([sys.executable, TOOL, ROOT], capture_output=True, text=True)
    assert "arrow up" not in p.stdout and "in no layer" not in p.stdout, p.stdout
    assert "every arrow goes down" in p.stdout, p.stdout


def test_the_package_root_holds_the_entry_points_only():
    """At most 8 files at starpu_llm/'s root (the commands, the package, errors, signals); the
    rest lives in the rooms (subpackages) that LAYERS orders."""
    root = [f for f in os.listdir(os.path.join(ROOT, "starpu_llm")) if f.endswith(".py")]
    assert len(root) <= 8, sorted(root)


def test_import_starpu_llm_stays_light():
    """`import starpu_llm` (its first line installs the signal handlers) loads no numpy: the
    rooms' __init__.py on that path import nothing heavy."""
    code = "import sys, starpu_llm; print('numpy' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.stdout.strip() == "False", p.stdout + p.stderr


def meson_modules(text: str) -> set:
    """The .py files meson.build installs: the root list and the foreach dictionary of rooms."""
    out = set(re.findall(r"'(starpu_llm/[\w/]+\.py)'", text))
    block = text[text.index("foreach sub, modules : {"):]
    block = block[:block.index("}")]
    for sub, mods in re.findall(r"'(\w+)':\s*\[([^\]]*)\]", block):
        out |= {f"starpu_llm/{sub}/{m}.py" for m in re.findall(r"'(\w+)'", mods)}
    return out


def test_meson_installs_every_module():
    """The wheel's install list (meson.build) names every .py file under starpu_llm/, and
    nothing that is not there."""
    on_disk = set()
    for dirpath, dirs, files in os.walk(os.path.join(ROOT, "starpu_llm")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        on_disk |= {os.path.relpath(os.path.join(dirpath, f), ROOT).replace(os.sep, "/")
                    for f in files if f.endswith(".py")}
    listed = meson_modules(open(os.path.join(ROOT, "meson.build"), encoding="utf-8").read())
    assert on_disk - listed == set(), f"not installed by meson.build: {sorted(on_disk - listed)}"
    assert listed - on_disk == set(), f"in meson.build, not on disk: {sorted(listed - on_disk)}"


def test_the_meson_check_can_fail():
    text = ("py.install_sources('starpu_llm/cli.py', subdir: 'starpu_llm')\n"
            "foreach sub, modules : {\n    'io': ['__init__', 'data']}\n")
    assert meson_modules(text) == {"starpu_llm/cli.py", "starpu_llm/io/__init__.py",
                                   "starpu_llm/io/data.py"}


def test_no_room_shadows_a_public_name():
    """A subpackage or module named as one of the package's public names (`starpu_llm.train`,
    the function) would replace that name once imported (`import starpu_llm.<room>` sets the
    attribute): `from starpu_llm import train` must stay the function, whatever was imported
    before."""
    import starpu_llm
    pkg = os.path.join(ROOT, "starpu_llm")
    rooms = {n[:-3] if n.endswith(".py") else n for n in os.listdir(pkg)
             if n.endswith(".py") or os.path.isfile(os.path.join(pkg, n, "__init__.py"))}
    assert not rooms & set(starpu_llm.__all__), rooms & set(starpu_llm.__all__)
    code = ("import importlib, pkgutil, starpu_llm\n"
            "for m in pkgutil.iter_modules(starpu_llm.__path__):\n"
            "    if m.ispkg: importlib.import_module('starpu_llm.' + m.name)\n"
            "from starpu_llm import train\n"
            "print(callable(train) and train.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "starpu_llm.training.trainer", out.stdout + out.stderr
