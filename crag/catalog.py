"""A warehouse given as `catalog.schema` (Unity Catalog, or any catalog of the session): its schema
exists before crag writes a table in it, or is created when the config asks (tables.create_schema)."""

from __future__ import annotations

from crag.errors import InputError, spark_error_line
from crag.secrets import scrub


def _quoted(identifier: str) -> str:
    return "`" + identifier.replace("`", "``") + "`"


def ensure_schema(spark, catalog: str, schema: str, create: bool) -> None:
    """InputError, saying what to do, when `catalog` has no schema `schema` (or there is no such
    catalog); with `create`, the schema is created instead (its catalog must exist). Spark would
    otherwise fail the first write with SCHEMA_NOT_FOUND, after the run has begun."""
    name = f"{_quoted(catalog)}.{_quoted(schema)}"
    known = _catalogs(spark)
    if catalog not in known and spark.conf.get(f"spark.sql.catalog.{catalog}", None) is None:
        # Spark would take `catalog` for a schema of its default catalog, and say it has no such schema
        raise InputError(
            f"warehouse {catalog}.{schema} was read as catalog.schema (no folder of that name exists), and this "
            f"Spark session has no catalog {catalog!r} (it has {', '.join(sorted(known)) or 'none'}): for a local "
            f"folder, give ./{catalog}.{schema}; a catalog of your own is configured with "
            f"spark.conf.spark.sql.catalog.{catalog}=<its class>"
        )
    try:
        exists = spark.catalog.databaseExists(name)
    except Exception as exc:  # a catalog this session may not read
        raise InputError(
            f"warehouse {catalog}.{schema}: the session cannot look into catalog {catalog} ({scrub(spark_error_line(exc))[:300]})"
        ) from None
    if exists:
        return
    if not create:
        raise InputError(
            f"warehouse {catalog}.{schema}: catalog {catalog} has no schema {schema}: create it "
            f"(CREATE SCHEMA {name}), or set tables.create_schema=true and crag creates it"
        )
    try:
        spark.sql(f"CREATE SCHEMA IF NOT EXISTS {name}")  # identifiers, quoted: no value enters the text
    except Exception as exc:
        raise InputError(
            f"warehouse {catalog}.{schema}: the schema could not be created ({scrub(spark_error_line(exc))[:300]})"
        ) from None


def _catalogs(spark) -> set[str]:
    """The catalogs the session lists (the ones it has loaded: one that is only configured may be
    missing, see ensure_schema)."""
    try:
        return {c.name for c in spark.catalog.listCatalogs()}
    except Exception:  # a session that cannot list them: its error comes with the schema's check
        return set()
