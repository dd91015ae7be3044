"""The docs stay true: the config reference (docs/configuration.md) and the README's two commands."""
from __future__ import annotations

import re

from conftest import ROOT
from fedmpi.config import SCHEMA, reference_markdown


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
        "python -c \"from fedmpi.config import reference_markdown as r; print(r())\"")
    for key in SCHEMA:
        assert f"`{key}`" in text


def test_ci_installs_and_tests_as_the_readme_says():
    text, ci = _readme(), (ROOT / ".ci" / "run").read_text()
    assert 'pip install -e ".[mpich,test]" && python -m pytest -q' in text
    assert 'pip install -e ".[mpich]" && fedmpi run configs/quickstart.yaml' in text
    assert 'pip install --quiet -e ".[mpich,test]"' in ci and "python -m pytest -q" in ci
