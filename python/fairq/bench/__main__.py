"""``python -m fairq.bench``: the same program as ``fairq bench``."""

import sys

from fairq.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
