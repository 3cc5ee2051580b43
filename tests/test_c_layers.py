"""The calls between the C files go one way (tools/c_calls.py): kernels at the bottom, the
codelet declarations above them, the StarPU layer on top, with no circle; and the checker
itself finds a circle where there is one."""
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("c_calls", ROOT / "tools" / "c_calls.py")
c_calls = importlib.util.module_from_spec(spec)
spec.loader.exec_module(c_calls)


def test_no_circle_among_the_c_files():
    graph = c_calls.call_graph(ROOT / "csrc")
    assert c_calls.cycles(graph) == []
    # the layers: kernels call no one above them; declarations call no StarPU file
    for f, callees in graph.items():
        if f.startswith("kernels/"):
            assert all(c.startswith("kernels/") for c in callees), (f, callees)
        if f.startswith("codelets/"):
            assert not any(c.startswith("starpu/") for c in callees), (f, callees)
    assert "starpu/submit.c" in graph["starpu/runtime.c"]


def test_the_checker_sees_a_circle(tmp_path):
    (tmp_path / "a.c").write_text("int f(void)\n{\n\treturn g(); /* h() */\n}\n")
    (tmp_path / "b.c").write_text("static int h(void) { return 1; }\nint g(void)\n{\n\treturn f();\n}\n")
    (tmp_path / "c.c").write_text('int k(void)\n{\n\tputs("f()");\n\treturn 0;\n}\n')
    graph = c_calls.call_graph(tmp_path)
    assert graph == {"a.c": {"b.c"}, "b.c": {"a.c"}, "c.c": set()}
    assert c_calls.cycles(graph) == [["a.c", "b.c"]]


# meson.build's C source lists and the folder each one builds (cuda_src: both builds, the CPU
# one #including each listed .cu into csrc/cuda/emulated.cpp.in)
SOURCE_LISTS = {"kernel_src": ("kernels", ".c"), "codelet_src": ("codelets", ".c"),
                "cuda_src": ("cuda", ".cu"), "starpu_src": ("starpu", ".c")}


def meson_sources(text: str) -> dict:
    """{list name: the files it names} of meson.build's `name = files(...)` source lists."""
    out = {}
    for name in SOURCE_LISTS:
        m = re.search(rf"^{name} = files\((.*?)\)", text, re.S | re.M)
        out[name] = set(re.findall(r"'([^']+)'", m.group(1))) if m else set()
    return out


def test_meson_builds_every_c_file():
    """A layer's new C file left out of meson.build is either never compiled (a codelet file:
    its codelets are silently not in the table) or an undefined symbol at import that names
    no file: this names the list it belongs in."""
    listed = meson_sources((ROOT / "meson.build").read_text())
    for name, (folder, ext) in SOURCE_LISTS.items():
        on_disk = {f"csrc/{folder}/{p.name}" for p in (ROOT / "csrc" / folder).glob(f"*{ext}")}
        missing, stale = sorted(on_disk - listed[name]), sorted(listed[name] - on_disk)
        assert not missing, f"add to meson.build's {name}: {missing}"
        assert not stale, f"in meson.build's {name}, not on disk: {stale}"


def test_the_meson_sources_check_can_fail():
    text = ("kernel_src = files(\n  'csrc/kernels/a.c', 'csrc/kernels/b.c')\n"
            "cuda_src = files('csrc/cuda/x.cu')\n")
    assert meson_sources(text) == {"kernel_src": {"csrc/kernels/a.c", "csrc/kernels/b.c"},
                                   "codelet_src": set(), "cuda_src": {"csrc/cuda/x.cu"},
                                   "starpu_src": set()}
