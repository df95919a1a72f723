"""Job entry point: `crag compare` with the job's parameters (--warehouse, --base, --candidate,
--report). Usable as a spark_python_task file."""

import sys

from crag.cli import main

if __name__ == "__main__":
    sys.exit(main(["compare", *sys.argv[1:]]))
