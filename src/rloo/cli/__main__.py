"""``python -m rloo.cli``: the same entry point as the ``rloo`` console script."""

import sys

from rloo.cli import main

sys.exit(main())
