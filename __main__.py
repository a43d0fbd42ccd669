"""``python -m quern ...``: the ``quern`` command (:mod:`quern.pipeline.cli`), with its exit status."""

import sys

from quern.pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main())
