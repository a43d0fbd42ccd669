"""The wheel's build hook: compile quern's two C libraries (``pipeline/native/``) with the C compiler.

hatchling runs this when it builds a wheel (``[tool.hatch.build.targets.wheel.hooks.custom]`` in
pyproject.toml). ``quern/pipeline/native/librowhash.so`` makes the batch digests' per-row hashing one
C call per leaf (``quern.pipeline.integrity.rowhash``); ``libimage.so`` resizes and normalizes ``uint8``
images (``quern.transforms.image.native``). With either, the wheel is tagged ``py3-none-PLATFORM``. A
library that does not compile is left out, with a warning, and quern does its work in Python or
NumPy instead (the same digests and pixels, slower). The compiler is ``$CC``, else Python's own
(``sysconfig``), else ``cc``. An editable install builds the libraries into the source tree.
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
LIBRARIES = {  # library -> (what it is for, in warnings; its sources; compiler flags of its own)
    "librowhash.so": ("row hash", ["rowhash.c"], []),
    # Pillow's weights and NumPy's float32 steps exactly: no fused multiply-add
    "libimage.so": ("image resize and normalize", ["resample.c", "normalize.c"], ["-ffp-contract=off"]),
}
X86 = ("x86_64", "amd64", "i386", "i686")


def compiler() -> list[str]:
    """The C compiler's command: ``$CC``, else Python's own (``sysconfig``), else ``cc``."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


def compile_library(source: Path, out: Path) -> str:
    """Compile the library named ``out.name`` (:data:`LIBRARIES`) from ``source`` into ``out``; the error, or ``""``."""
    _, files, flags = LIBRARIES[out.name]
    cmd = [*compiler(), "-O3", "-std=c99", "-shared", "-fPIC", "-fvisibility=hidden", *flags]
    if sys.platform == "darwin":
        cmd.append("-dynamiclib")
    paths = [str(source / f) for f in files]
    if out.name == "librowhash.so" and platform.machine().lower() in X86:  # SSE2, AVX2 or AVX-512 at run time
        cmd.append("-DQUERN_X86_DISPATCH")
        paths.append(str(source / "xxhash" / "xxh_x86dispatch.c"))
    cmd += ["-o", str(out), *paths, "-lm"]
    if shutil.which(cmd[0]) is None:
        return f"no C compiler {cmd[0]!r}"
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        return f"{shlex.join(cmd)} failed:\n{run.stdout}{run.stderr}"
    return ""


class CustomBuildHook(BuildHookInterface):
    """Compile the row hash into the wheel (or, for an editable install, into the source tree)."""

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        """Compile the libraries and add them to the wheel; one that cannot be compiled is left out (a warning)."""
        if self.target_name != "wheel":
            return
        source = Path(self.root) / NATIVE
        self._temp: str | None = None if version == "editable" else tempfile.mkdtemp(prefix="quern-native-")
        for name, (what, _, _) in LIBRARIES.items():
            out = source / name if self._temp is None else Path(self._temp) / name
            why = compile_library(source, out)
            if why:
                print(
                    f"warning: quern's {what} was not compiled ({why.strip()}); quern does that work in Python "
                    "instead (the same results, slower)",
                    file=sys.stderr,
                )
                continue
            if self._temp is not None:
                build_data["force_include"][str(out)] = f"{NATIVE.as_posix()}/{name}"  # under quern/ (sources)
                build_data["pure_python"] = False
                # any Python 3 (ctypes loads it), this platform only
                build_data["tag"] = "py3-none-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        """Remove the folder the library was compiled into."""
        temp = getattr(self, "_temp", None)
        if temp:
            shutil.rmtree(temp, ignore_errors=True)
