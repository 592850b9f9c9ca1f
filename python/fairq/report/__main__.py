"""``python -m fairq.report``: the same program as ``fairq report``."""

import sys

from fairq.report.cli import main

if __name__ == "__main__":
    sys.exit(main())
