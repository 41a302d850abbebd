"""``python -m meshcomm``: same as the ``meshcomm`` command."""

import sys

from .cli import main

sys.exit(main())
