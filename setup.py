"""Which folders are the package: discovered, never listed (the metadata is in pyproject.toml).

The repository root is the import package ``quern``; every folder below it with an
``__init__.py`` is one of its subpackages, except the folders that are not part of
the package (tests, benchmarks, examples, documentation, build output). A new
subpackage is in the wheel and the sdist without anyone editing a list.
"""

import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
NOT_PACKAGE = ["tests", "benchmarks", "examples", "docs", "build", "dist", "site"]
SUBPACKAGES = find_packages(ROOT, exclude=[*NOT_PACKAGE, *(f"{d}.*" for d in NOT_PACKAGE)])


class BuildPy(build_py):
    """``build_py`` without this file: it lies in the package's folder but is not one of its modules."""

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        """The package's modules, less ``setup.py`` itself (setuptools skips it only when run as a script)."""
        found = super().find_package_modules(package, package_dir)
        return [m for m in found if os.path.abspath(m[2]) != os.path.abspath(__file__)]


setup(
    package_dir={"quern": "."},
    packages=["quern", *(f"quern.{p}" for p in SUBPACKAGES)],
    cmdclass={"build_py": BuildPy},
)
