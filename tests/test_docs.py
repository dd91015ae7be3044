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


def test_getting_started_commands_run(tmp_path):
    """Every command of docs/getting-started.md runs as written, in order, in one
    directory (as a newcomer would type them), after the install steps CI runs itself."""
    import os
    import shutil
    import subprocess

    from conftest import fedmpi_cmd, mpiexec_path

    (tmp_path / "configs").symlink_to(ROOT / "configs")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
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
            else:
                assert argv[0] == "fedmpi", f"unexpected command in getting-started.md: {part}"
                argv = fedmpi_cmd(*argv[1:])
            proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=600)
            assert proc.returncode == 0, f"{part!r} exited {proc.returncode}: {proc.stderr[-2000:]}"
            ran.append(part)
    assert any("mpiexec" in p for p in ran) or shutil.which("mpiexec") is None
    assert any(p.startswith("fedmpi run configs/quickstart.yaml") for p in ran)
