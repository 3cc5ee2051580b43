"""The calls between the C files go one way (tools/c_calls.py): kernels at the bottom, the
codelet declarations above them, the StarPU layer on top, with no circle; and the checker
itself finds a circle where there is one."""
import importlib.util
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
