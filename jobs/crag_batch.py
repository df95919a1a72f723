"""Job entry point: `crag run` with the job's parameters (--conf, --questions, --warehouse, --variant,
--run-id, --set KEY=VALUE). Usable as a spark_python_task file; the same call as `crag run`."""

import sys

from crag.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
