"""``python -m clipless``: the ``clipless`` command."""

import sys

from .cli import main

sys.exit(main())
