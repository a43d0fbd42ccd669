"""The suite runs against the installed package, and the wheel and the sdist hold the whole package.

The build (hatchling, configured in pyproject.toml) ships every module of the root under
``quern/``, found by globbing; a module left out of the wheel fails here, as does anything of
``tests/``, ``benchmarks/`` or ``examples/`` that is shipped. ``make test`` installs the wheel built from the checkout and runs the suite
from a folder outside it, so in the editable development environment the first test fails.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

import quern

ROOT = Path(__file__).resolve().parents[1]  # the checkout: the source tree of the package quern
INSTALLED = Path(quern.__file__).resolve().parent
NOT_PACKAGE = ("tests", "benchmarks", "examples", "docs", "build", "dist", "site")  # as pyproject excludes
NOT_SHIPPED = ("tests", "benchmarks", "examples")
BUILD_HOOK = ".build/hatch_build.py"  # the wheel's build hook (compiles pipeline/native/): in the sdist, not the wheel


def _checkout_files() -> list[str]:
    """The checkout's files that exist (tracked, and untracked but not ignored), as relative posix paths."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"the checkout's file list comes from git, and `git ls-files` failed in {ROOT}: {e}")
    return sorted({f for f in out.decode().split("\0") if f and (ROOT / f).is_file()})


def _package_modules(files: list[str]) -> set[str]:
    """The package's modules among the checkout's ``files``, relative to the package's folder (the root)."""
    out = set()
    for f in files:
        parts = f.split("/")
        if f.endswith(".py") and parts[0] not in NOT_PACKAGE:
            if not any(p.startswith(".") for p in parts):
                out.add(f)
    return out


def test_the_suite_runs_against_the_installed_package():
    site = [Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")]
    in_tree = INSTALLED.is_relative_to(ROOT) and not any(INSTALLED.is_relative_to(s) for s in site)
    assert not in_tree, (
        f"quern is imported from the source tree ({quern.__file__}), not from an installed wheel: "
        "`make test` builds the wheel, installs it and runs the suite from a folder outside the checkout"
    )
    elsewhere = [
        name
        for name, module in list(sys.modules.items())
        if name.partition(".")[0] == "quern"
        and getattr(module, "__file__", None)
        and not Path(module.__file__).resolve().is_relative_to(INSTALLED)
    ]
    assert not elsewhere, f"quern modules imported from outside {INSTALLED}: {elsewhere}"


def test_the_installed_package_is_the_whole_package_and_nothing_else():
    if INSTALLED == ROOT:
        pytest.skip("quern is the source tree here (see test_the_suite_runs_against_the_installed_package)")
    want = _package_modules(_checkout_files())
    have = {p.relative_to(INSTALLED).as_posix() for p in INSTALLED.rglob("*.py")}
    assert not sorted(want - have), (
        f"modules of the checkout missing from the installed package {INSTALLED} (a folder without "
        f"__init__.py is not a package): {sorted(want - have)}"
    )
    assert not sorted(have - want), f"installed modules that are not the checkout's: {sorted(have - want)}"
    assert not [d for d in NOT_SHIPPED if (INSTALLED / d).exists()]
    # the distribution installed beside the package (not a quern.egg-info a build left in a checkout on sys.path)
    here = [d for d in importlib.metadata.distributions(path=[str(INSTALLED.parent)]) if d.metadata["Name"] == "quern"]
    recorded = {f.as_posix() for d in here for f in (d.files or [])}
    assert "quern/__init__.py" in recorded, "the distribution quern is not installed from a wheel (editable?)"
    outside = [f for f in recorded if f.split("/")[0] != "quern" and not f.split("/")[0].endswith(".dist-info")]
    assert all(f.startswith("../") for f in outside), outside  # only the console script, in bin/


def _missing_build_tools() -> list[str]:
    """The test extra's build tools that this environment lacks (an editable install may predate them)."""
    missing = [m for m in ("build", "twine") if importlib.util.find_spec(m) is None]
    if importlib.util.find_spec("hatchling") is None:
        missing.append("hatchling")
    return missing


def test_the_wheel_and_the_sdist_hold_the_package_and_nothing_else(tmp_path):
    if missing := _missing_build_tools():
        pytest.skip(f"needs the test extra's build tools: {', '.join(missing)} (pip install -e '.[test]')")
    files = _checkout_files()
    src, dist = tmp_path / "src", tmp_path / "dist"
    for f in files:  # a clean copy: no build/, egg-info or ignored file of the working tree plays a part
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    # the sdist, then the wheel built from the sdist (so the sdist is complete, too)
    run = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    want = _package_modules(files)

    names = zipfile.ZipFile(wheel).namelist()
    modules = {n.removeprefix("quern/") for n in names if n.startswith("quern/") and n.endswith(".py")}
    assert not sorted(want - modules), f"missing from the wheel: {sorted(want - modules)}"
    assert not sorted(modules - want), f"in the wheel but not modules of the package: {sorted(modules - want)}"
    assert "quern/py.typed" in names
    if shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc"):  # hatch_build.py compiled the libraries
        assert "quern/pipeline/native/librowhash.so" in names, "the wheel lacks the compiled row hash"
        assert "quern/pipeline/native/libimage.so" in names, "the wheel lacks the compiled image kernels"
    assert not [n for n in names if n.split("/")[0] != "quern" and not n.split("/")[0].endswith(".dist-info")]

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert wheel.name.startswith(f"quern-{version}-"), (wheel.name, version)
    assert quern.__version__ == version  # pipeline/version.py, what each service actor compares with the trainer's

    with tarfile.open(sdist) as tar:
        names = [n.partition("/")[2] for n in tar.getnames()]  # below the top folder quern-VERSION/
    modules = {n for n in names if n.endswith(".py")}
    assert not sorted(want - modules), f"missing from the sdist: {sorted(want - modules)}"
    assert modules - want == {BUILD_HOOK}, sorted(modules - want)
    native = {f for f in files if f.startswith("pipeline/native/")}  # the libraries' C sources
    assert native and native <= set(names), sorted(native - set(names))
    assert not [n for n in names if n.split("/")[0] in NOT_SHIPPED]
    assert {"pyproject.toml", "README.md", "py.typed"} <= set(names)

    check = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
