"""``python -m fairq.demo``: the same program as ``fairq demo``."""

import sys

from fairq.demo.cli import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
