"""The namespace is linked: ``src/gpusnap/<name>`` is the top-level folder ``<name>/``.

The subpackages live at the top of the repository (``cli/``, ``daemon/``, ``proto/``,
``storage/``) and ``src/gpusnap`` links each in, so that an editable install, a wheel and
import-linter all see them as ``gpusnap.<name>``. A link that points elsewhere, or a file
put into ``src/gpusnap`` beside the links, would be a second copy of the package that the
tests do not see.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = REPO / "src" / "gpusnap"
LINKED = ("cli", "daemon", "proto", "storage")
ROOT_FILES = ("__init__.py", "errors.py", "py.typed", "seccomp.py")


@pytest.mark.parametrize("name", LINKED)
def test_each_subpackage_is_a_relative_link_to_its_top_level_folder(name: str) -> None:
    link = NAMESPACE / name
    assert link.is_symlink(), f"{link} is not a link"
    # Relative, so that a checkout moved or copied elsewhere still links to itself.
    assert os.readlink(link) == f"../../{name}"
    assert link.resolve() == (REPO / name).resolve()
    assert (REPO / name / "__init__.py").is_file()


def test_the_namespace_holds_nothing_but_its_root_files_and_the_links() -> None:
    entries = {p.name for p in NAMESPACE.iterdir() if p.name != "__pycache__"}
    assert entries == {*LINKED, *ROOT_FILES}
    for name in ROOT_FILES:
        assert not (NAMESPACE / name).is_symlink()
        assert (NAMESPACE / name).is_file()


@pytest.mark.parametrize("name", LINKED)
def test_the_imported_subpackage_is_the_top_level_folder(name: str) -> None:
    module = importlib.import_module(f"gpusnap.{name}")
    assert module.__file__ is not None
    assert Path(module.__file__).resolve() == (REPO / name / "__init__.py").resolve()
