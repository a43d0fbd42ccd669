"""``python -m quern.pipeline.cli ...``: the ``quern`` command, with its exit status."""

import sys

from quern.pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main())
