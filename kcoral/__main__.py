"""``python -m kcoral``: the same entry point as the ``kcoral`` command."""

import sys

from kcoral.cli import main

sys.exit(main())
