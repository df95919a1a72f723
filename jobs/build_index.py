"""Job entry point: `crag index` with the job's parameters (--conf, --docs, --out)."""

import sys

from crag.cli import main

if __name__ == "__main__":
    sys.exit(main(["index", *sys.argv[1:]]))
