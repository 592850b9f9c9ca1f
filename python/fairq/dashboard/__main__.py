"""``python -m fairq.dashboard``: the same program as ``fairq dashboard``."""

import sys

from fairq.dashboard.cli import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
