"""The wheel's build hook: compile quern's row hash (``pipeline/native/rowhash.c``) with the C compiler.

hatchling runs this when it builds a wheel (``[tool.hatch.build.targets.wheel.hooks.custom]`` in
pyproject.toml). The library, ``quern/pipeline/native/librowhash.so``, makes the batch digests'
per-row hashing one C call per leaf (``quern.pipeline.integrity.rowhash``); the wheel is then tagged
``py3-none-PLATFORM``. Without a working C compiler the wheel is built without it, with a warning, and quern
hashes row by row in Python (the same digests, slower). The compiler is ``$CC``, else Python's own
(``sysconfig``), else ``cc``. An editable install builds the library into the source tree.
"""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

NATIVE = Path("pipeline") / "native"
LIBRARY = "librowhash.so"


def compiler() -> list[str]:
    """The C compiler's command: ``$CC``, else Python's own (``sysconfig``), else ``cc``."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


def compile_library(source: Path, out: Path) -> str:
    """Compile ``source/rowhash.c`` into the shared library ``out``; the error, or ``""``."""
    cmd = [*compiler(), "-O3", "-std=c99", "-shared", "-fPIC", "-fvisibility=hidden"]
    if sys.platform == "darwin":
        cmd.append("-dynamiclib")
    files = [str(source / "rowhash.c")]
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):  # SSE2, AVX2 or AVX-512 at run time
        cmd.append("-DQUERN_X86_DISPATCH")
        files.append(str(source / "xxhash" / "xxh_x86dispatch.c"))
    cmd += ["-o", str(out), *files]
    if shutil.which(cmd[0]) is None:
        return f"no C compiler {cmd[0]!r}"
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        return f"{shlex.join(cmd)} failed:\n{run.stdout}{run.stderr}"
    return ""


class CustomBuildHook(BuildHookInterface):
    """Compile the row hash into the wheel (or, for an editable install, into the source tree)."""

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        """Compile the library and add it to the wheel, unless it cannot be compiled (a warning)."""
        if self.target_name != "wheel":
            return
        source = Path(self.root) / NATIVE
        self._temp: str | None = None if version == "editable" else tempfile.mkdtemp(prefix="quern-native-")
        out = source / LIBRARY if self._temp is None else Path(self._temp) / LIBRARY
        why = compile_library(source, out)
        if why:
            print(
                f"warning: quern's row hash was not compiled ({why.strip()}); the wheel hashes batch digests "
                "row by row in Python instead (the same digests, slower)",
                file=sys.stderr,
            )
            return
        if self._temp is not None:
            build_data["force_include"][str(out)] = f"{NATIVE.as_posix()}/{LIBRARY}"  # under quern/ (sources)
            build_data["pure_python"] = False
            # any Python 3 (ctypes loads it), this platform only
            build_data["tag"] = "py3-none-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        """Remove the folder the library was compiled into."""
        temp = getattr(self, "_temp", None)
        if temp:
            shutil.rmtree(temp, ignore_errors=True)
