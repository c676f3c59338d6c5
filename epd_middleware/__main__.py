"""``python -m epd_middleware check``: the same as the ``epd-middleware`` command."""

import sys

from .cli import main

sys.exit(main())
