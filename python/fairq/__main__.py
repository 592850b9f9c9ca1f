"""``python -m fairq``: the same as the ``fairq`` command."""

import sys

from fairq.cli import main

sys.exit(main())
