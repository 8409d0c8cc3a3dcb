"""``python -m rill.bench``: the same as ``rill bench``."""

import sys

from rill.bench.cli import main

sys.exit(main())
