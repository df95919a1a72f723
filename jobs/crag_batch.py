"""crag_batch, the main job: answer a table of questions with one prompt variant.

Databricks runs this file for the bundle's scheduled job (resources/jobs.yml: a Python script task on
serverless compute, the crag wheel installed beside it), and `make sample` runs it on the bundled
sample with the embedded default. Its arguments are those of `crag run` (see `crag run --help`).
It exits with crag's exit code (0 done, 2 an error crag names in one line, 130/143 interrupted), which
a Python script task reports as its result: a run that fails fails its task.
"""

import sys

from crag.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["run", *sys.argv[1:]]))
