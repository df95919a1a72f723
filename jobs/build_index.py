"""build_index: chunk the documents, write the chunk table and its search index.

Databricks runs this file for the bundle's build_index job (resources/jobs.yml: a Python script task on
serverless compute, the crag wheel installed beside it), and `make sample` runs it for the bundled
sample's knowledge base and web collection. Its arguments are those of `crag index` (see
`crag index --help`).
It exits with crag's exit code, which a Python script task reports as its result.
"""

import sys

from crag.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["index", *sys.argv[1:]]))
