"""``python -m hybridrl``: the command line of :mod:`hybridrl.cli`."""

import sys

from hybridrl.cli import main

sys.exit(main())
