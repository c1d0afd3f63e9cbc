"""``python -m kcoral.cli``: the same entry point as the ``kcoral`` command."""

import sys

from kcoral.cli.main import main

sys.exit(main())
