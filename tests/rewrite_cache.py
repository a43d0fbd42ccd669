"""Write pytest's assert-rewritten bytecode of the test modules once, before the suite's workers start.

pytest rewrites the ``assert`` statements of every test module and ``conftest.py`` when it imports them, in
each of ``make test``'s worker processes: about 4 s of CPU per worker on the project's 2-core machine, where
``PYTHONDONTWRITEBYTECODE`` keeps pytest from caching the result. This script does it once, beside the
wheel's build, into the ``__pycache__`` files pytest reads (each checked against its source's hash, so a
stale one is rewritten as before). It writes nothing where pytest's rewriting depends on its configuration
(``enable_assertion_pass_hook`` in pyproject.toml). Best effort: where pytest's internals differ from what it
expects, it says so and stops, and the suite rewrites the modules it did not write.

    python tests/rewrite_cache.py [FOLDER]   (default: the folder of this file)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(folder: Path) -> int:
    try:
        import tomllib

        from _pytest.assertion import rewrite

        ini = tomllib.loads((folder.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
        if ini.get("enable_assertion_pass_hook"):
            print("tests/rewrite_cache.py: nothing cached (enable_assertion_pass_hook is set)", file=sys.stderr)
            return 0

        files = [p for p in folder.rglob("*.py") if p.name.startswith("test_") or p.name == "conftest.py"]
        for path in files:
            source_hash, code = rewrite._rewrite_test(path, None)  # type: ignore[arg-type]
            pyc = rewrite.get_cache_dir(path) / (path.name[:-3] + rewrite.PYC_TAIL)
            pyc.parent.mkdir(parents=True, exist_ok=True)
            tmp = pyc.with_name(f"{pyc.name}.{os.getpid()}")
            with open(tmp, "wb") as fp:
                rewrite._write_pyc_fp(fp, source_hash, code)
            os.replace(tmp, pyc)
    except Exception as e:  # noqa: BLE001 - an optimisation only: the suite rewrites what is not here
        print(f"tests/rewrite_cache.py: nothing cached ({type(e).__name__}: {e})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent))
