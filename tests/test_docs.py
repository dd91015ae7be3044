"""The docs stay true: the config reference (docs/configuration.md) and the README's two commands."""
from __future__ import annotations

import re

from conftest import ROOT
from fedmpi.config.schema import SCHEMA, reference_markdown


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _config_page() -> str:
    return (ROOT / "docs" / "configuration.md").read_text()


def test_config_reference_in_docs_matches_schema():
    text = _config_page()
    block = re.search(r"<!-- config-reference:start -->\n(.*?)\n<!-- config-reference:end -->", text, re.S)
    assert block, "docs/configuration.md lacks the config reference markers"
    assert block.group(1) == reference_markdown(), (
        "docs/configuration.md config reference is stale: regenerate it with "
        "python -c \"from fedmpi.config.schema import reference_markdown as r; print(r())\"")
    for key in SCHEMA:
        assert f"`{key}`" in text


def test_ci_installs_and_tests_as_the_readme_says():
    text, ci = _readme(), (ROOT / ".ci" / "run").read_text()
    assert 'pip install -e ".[mpich,test]" && python -m pytest -q' in text
    assert 'pip install -e ".[mpich]" && fedmpi run configs/quickstart.yaml' in text
    assert 'pip install --quiet -e ".[mpich,test]"' in ci and "python -m pytest -q" in ci


def _shell_blocks(page: str) -> list[str]:
    """The ```bash code blocks of a docs page, as one command per line."""
    text = (ROOT / "docs" / page).read_text()
    return [line.split("#", 1)[0].strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
            for line in block.splitlines() if line.split("#", 1)[0].strip()]


#: install steps of a command line: CI runs them itself (.ci/run), on a fresh virtualenv
_SETUP = ("python3 -m venv", ". .venv/bin/activate", "pip install", "python -m pytest")


def test_getting_started_commands_run(tmp_path, monkeypatch):
    """Every command of docs/getting-started.md runs as written, in order, in one
    directory (as a newcomer would type them), after the install steps CI runs itself.
    A ``fedmpi`` command runs in this process (:func:`fedmpi.cli.main`; the console
    entry point itself: tests/test_cli.py), an ``mpiexec`` line as a launch."""
    import shutil
    import subprocess

    from conftest import fedmpi_cmd, mpiexec_path
    from fedmpi.cli import main

    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ran = []
    for line in _shell_blocks("getting-started.md"):
        for part in (p.strip() for p in line.split("&&")):
            if part.startswith(_SETUP) or part in ran:
                continue
            argv = part.split()
            if argv[0] == "mpiexec":
                mpi = mpiexec_path()
                if mpi is None:
                    continue
                argv = [mpi, *argv[1:argv.index("fedmpi")], *fedmpi_cmd(*argv[argv.index("fedmpi") + 1:])]
                proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True,
                                      timeout=600)
                code, err = proc.returncode, proc.stderr[-2000:]
            else:
                assert argv[0] == "fedmpi", f"unexpected command in getting-started.md: {part}"
                code, err = main(argv[1:]), ""
            assert code == 0, f"{part!r} exited {code}: {err}"
            ran.append(part)
    assert any("mpiexec" in p for p in ran) or shutil.which("mpiexec") is None
    assert any(p.startswith("fedmpi run configs/quickstart.yaml") for p in ran)


def _file_map() -> dict[str, set[str]]:
    """docs/architecture.md's file map: package (``""`` for the top) → the file names it
    lists under that package's ``fedmpi/<pkg>/`` header."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"## The file map\n\n```\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md lacks its file map"
    listed: dict[str, set[str]] = {"": set()}
    current = ""
    for line in block.group(1).splitlines():
        head = re.match(r"fedmpi/([\w/.]*)", line)
        if head and not line.startswith(" "):
            path = head.group(1)
            if path.endswith(".py"):     # a top-level module
                current = ""
                listed[""].add(path)
                continue
            current = path.rstrip("/")
            listed.setdefault(current, set()).add("__init__.py")
            line = line[head.end():]
        listed.setdefault(current, set()).update(re.findall(r"\b(\w+\.py)\b", line))
    return listed


def test_the_architecture_map_names_every_module():
    """Every module under fedmpi/ is in docs/architecture.md's file map, under its package
    (issue 34: the map had missed 12 of 15 data/ modules, MLP, ViT and privacy/)."""
    listed = _file_map()
    missing = []
    for path in sorted((ROOT / "fedmpi").rglob("*.py")):
        rel = path.relative_to(ROOT / "fedmpi")
        package = "/".join(rel.parts[:-1])
        if path.name not in listed.get(package, set()):
            missing.append(str(rel))
    assert not missing, f"docs/architecture.md's file map misses {missing}"
