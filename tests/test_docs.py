"""The README and docs/ hold together (tools/doc_links.py): every relative link leads to a file
and, with an #anchor, to a heading GitHub would give that anchor; every reference to raw data
(experiments/results/, docs/figures/: a link or a `path`) names what exists, each CSV of it with
a header row and a data row; and the README keeps the
commands that CI (.ci/run: "the README's test command") and the GPU tests' skip reasons
("README, GPUs: make cuda") send a reader to; the starpu-llm commands of the README and docs/
parse and their Python examples import what they name."""
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("doc_links", ROOT / "tools" / "doc_links.py")
doc_links = importlib.util.module_from_spec(spec)
spec.loader.exec_module(doc_links)


def test_every_relative_link_of_the_readme_and_docs_resolves():
    assert doc_links.broken_links(ROOT) == []


def test_the_checker_sees_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A\n\n## Measured at HEAD: `--x` and llama.cpp's server\n\n## Twice\n\n## Twice\n\n"
        "```sh\n# not a heading\n```\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md#measured-at-head---x-and-llamacpps-server) [second](docs/a.md#twice-1)\n"
        "[gone](docs/b.md) [no such](docs/a.md#not-a-heading)\n"
        "```\n[in code](nowhere.md)\n```\n`[in a span](nowhere.md)` [self](#nothing-here)\n"
        "[web](https://example.org/x.md#y) ![img](docs/a.md)\n"
        "a link [wrapped over\ntwo lines](docs/c.md), `a span\n[over two](nowhere.md)`\n\n"
        "[a paragraph\n\napart](nowhere.md)\n")
    assert doc_links.broken_links(tmp_path) == [
        ("README.md", 2, "docs/b.md", "no such file"),
        ("README.md", 2, "docs/a.md#not-a-heading", "no heading #not-a-heading in a.md"),
        ("README.md", 6, "#nothing-here", "no heading #nothing-here in README.md"),
        ("README.md", 8, "docs/c.md", "no such file"),     # the line it starts on
    ]


def test_the_readme_keeps_the_commands_ci_and_the_tests_point_to():
    readme = (ROOT / "README.md").read_text()
    sections = dict(re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", readme, re.M | re.S))
    assert "make train" in sections["Quick start"] and "make test " in sections["Quick start"]
    assert "make cuda" in sections["GPUs"] and "make test-cuda" in sections["GPUs"]
    assert "make test" in sections["Tests"]


def test_every_reference_to_raw_data_names_a_file_with_rows():
    # each number the docs quote stands on raw data beside it (experiments/results/, docs/figures/)
    assert doc_links.raw_data_problems(ROOT) == []


def test_the_raw_data_check_sees_a_missing_file_and_a_csv_without_rows(tmp_path):
    raw = tmp_path / "experiments" / "results" / "x"
    raw.mkdir(parents=True)
    (raw / "good.csv").write_text("a,b\n1,2\n")
    (raw / "header_only.csv").write_text("a,b\n\n")
    (raw / "empty.csv").write_text("")
    (tmp_path / "docs" / "figures").mkdir(parents=True)
    (tmp_path / "docs" / "figures" / "no_header.csv").write_text("1\n")
    (tmp_path / "docs" / "a.md").write_text(
        "[ok](../experiments/results/x/good.csv) [gone](../experiments/results/x/gone.csv)\n"
        "[rows](../experiments/results/x/header_only.csv) [other](b.md)\n"
        "`docs/figures/no_header.csv` `experiments/results/<cpu kind>/` `experiments/results/y*/`\n"
        "```sh\nls `experiments/results/in_code.csv` experiments/results/z.csv\n```\n")
    (tmp_path / "README.md").write_text("raw rows: `experiments/results/x/`\n")
    assert doc_links.raw_data_problems(tmp_path) == [
        ("README.md", 1, "experiments/results/x/",
         "experiments/results/x/empty.csv: empty CSV"),
        ("README.md", 1, "experiments/results/x/",
         "experiments/results/x/header_only.csv: CSV with a header and no data row"),
        ("docs/a.md", 1, "../experiments/results/x/gone.csv", "no such file"),
        ("docs/a.md", 2, "../experiments/results/x/header_only.csv",
         "experiments/results/x/header_only.csv: CSV with a header and no data row"),
        ("docs/a.md", 3, "docs/figures/no_header.csv",
         "docs/figures/no_header.csv: CSV without a header row"),
        ("docs/a.md", 3, "experiments/results/y*/", "no such file"),
    ]


def _doc_blocks(langs: str) -> list[tuple[str, str]]:
    """The fenced blocks of the README and docs/ in the languages `langs` (a regex), each with
    where it starts (file:line)."""
    blocks = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        blocks += [(f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 2}", m.group(1))
                   for m in re.finditer(rf"^```(?:{langs})\n(.*?)^```", text, re.M | re.S)]
    return blocks


def _starpu_llm_commands(block: str) -> list[list[str]]:
    """The starpu-llm command lines of a shell block, each as the words after the command:
    continuation lines joined, comments dropped, `a && b` and `a | b` split."""
    import shlex
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words, command = shlex.split(line, comments=True), None
        for w in words + ["&&"]:
            if w in ("&&", "|", ";", "||"):
                if command is not None:
                    commands.append(command)
                command = None
            elif command is not None:
                command.append(w)
            elif w == "starpu-llm" or w.endswith("/starpu-llm"):
                command = []
    return commands


def test_every_starpu_llm_command_of_the_readme_and_docs_parses(capsys):
    # a flag renamed or removed, or a value its flag refuses, in a command a reader copies; a
    # synopsis (`train ... [--limit N]`) is not a command
    from starpu_llm import cli
    commands = [(where, c) for where, block in _doc_blocks("sh|bash")
                for c in _starpu_llm_commands(block)
                if not any(w == "..." or w.startswith("[") for w in c)]
    refused = []
    for where, argv in commands:
        try:
            cli.build_parser().parse_args(argv)
        except cli.UsageError as e:
            refused.append((where, argv, str(e).splitlines()[-1]))
        except SystemExit as e:         # --version, --help: their output, then exit 0
            if e.code:
                refused.append((where, argv, e.code))
    assert refused == [] and len(commands) >= 45, (refused, len(commands))
    assert _starpu_llm_commands('X=1 starpu-llm a --b "c d" \\\n  --e  # f\n'
                                "starpu-llm g && .venv/bin/starpu-llm h | tail\nls\n") == [
        ["a", "--b", "c d", "--e"], ["g"], ["h"]]


def test_the_python_examples_of_the_readme_and_docs_compile_and_import_what_they_name():
    # each snippet's imports resolve against the package as it is (a name moved or renamed)
    import ast
    import importlib
    blocks = _doc_blocks("python")
    assert len(blocks) >= 5
    missing = []
    for line, block in blocks:
        tree = ast.parse(block, filename=line)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                for a in node.names:
                    try:        # an attribute, or a submodule (`from starpu_llm.io import hf`)
                        getattr(module, a.name, None) or importlib.import_module(
                            f"{node.module}.{a.name}")
                    except ImportError:
                        missing.append((line, node.module, a.name))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    importlib.import_module(a.name)
    assert missing == []
