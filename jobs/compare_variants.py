"""compare_variants: compare two runs (prompt variants) question by question.

Databricks runs this file for the bundle's compare_variants job (resources/jobs.yml: a Python script
task on serverless compute, the crag wheel installed beside it). Its arguments are those of
`crag compare` (see `crag compare --help`): it writes the `comparisons` table and an HTML report.
It exits with crag's exit code, which a Python script task reports as its result.
"""

import sys

from crag.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["compare", *sys.argv[1:]]))
