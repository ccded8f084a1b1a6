"""Fixtures of the generator tests: the declared tree rendered once per session, copied per test.

Rendering the whole declared tree takes a fraction of a second; verifying it (libcst) takes seconds,
so the shared copy is written without verification: the tests that are about verification run it
themselves. A test that needs "the repo" gets a copy and `codegen.generate.ROOT` pointed at it, so
no test ever writes the real generated/.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from codegen.files import write_verified
from codegen.generate import declared_generation, declared_plans, project_models
from registry.declarations import load_models
from registry.impls import load_registry


@pytest.fixture(scope="session")
def project():
    """(declarations, registry, declared plans) of the project, loaded once."""
    decls = project_models(load_models())
    return decls, load_registry(), declared_plans(decls)


@pytest.fixture(scope="session")
def declared_tree(project, tmp_path_factory) -> Path:
    """A repo-shaped folder (generated/, docs/, schemas/) holding exactly what the registry declares."""
    decls, registry, plans = project
    root = tmp_path_factory.mktemp("declared")
    gen = declared_generation(decls, registry, plans=plans)
    for name, outputs in gen.roots.items():
        write_verified(outputs, root / name)
    return root


@pytest.fixture
def repo(declared_tree, tmp_path, monkeypatch) -> Path:
    """A private copy of the declared tree that `python -m codegen` (in-process) treats as the repo."""
    root = tmp_path / "repo"
    shutil.copytree(declared_tree, root)
    monkeypatch.setattr("codegen.generate.ROOT", root)
    return root
