"""Every folder that is a package is shipped: the explicit list in pyproject.toml (needed
because the subpackages live in top-level folders) must not fall behind the tree."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = {v: k for k, v in cfg["package-dir"].items()}
    found = set()
    for folder, name in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            parts = [] if str(rel) == "." else list(rel.parts)
            found.add(".".join([name, *parts]))
    # A folder of data files only (fpgaccl.hw.lint: Verilator waivers) is listed with its
    # package-data and has no __init__.py.
    data_only = set(cfg["package-data"]) - found
    for name in data_only:
        parts = name.split(".")
        k = max(i for i in range(1, len(parts) + 1)
                if ".".join(parts[:i]) in cfg["package-dir"])
        folder = ROOT / cfg["package-dir"][".".join(parts[:k])] / Path(*parts[k:])
        assert folder.is_dir() and not (folder / "__init__.py").exists(), name
    assert data_only <= listed, "a data folder in package-data is not a listed package"
    assert found == listed - data_only


def test_the_c_fast_path_source_is_shipped():
    # host/native.py builds host/fastpath.c on first use, so an installed (not editable)
    # package must carry the source.
    from fpgaccl.host import native
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert native.SOURCE.name in cfg["package-data"]["fpgaccl.host"]
    assert native.SOURCE.exists()
