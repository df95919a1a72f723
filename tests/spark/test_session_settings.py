"""`spark.conf` reaches the Spark session, and a `catalog.schema` warehouse whose schema is missing is
said (or created) before anything is written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from crag.catalog import ensure_schema
from crag.config import SparkConfig
from crag.errors import ConfigError, InputError
from crag.spark import _with_runtime_settings, class_archive
from crag.spark_server import server_command
from tests.support import REPO


def test_a_new_local_session_gets_spark_conf_static_settings_included():
    """A catalog of the user's own, a static setting and a runtime one, given in the config, are the
    new session's."""
    probe = (
        "from crag.config import load_config; from crag.spark import get_spark;"
        "cfg = load_config(None, ['spark.master=local[1]',"
        " 'spark.conf.spark.sql.catalog.lake=org.apache.spark.sql.delta.catalog.DeltaCatalog',"
        " 'spark.conf.spark.driver.maxResultSize=123m', 'spark.conf.spark.sql.ansi.enabled=false']);"
        "s = get_spark(cfg.spark);"
        "print(s.conf.get('spark.sql.catalog.lake'), s.conf.get('spark.driver.maxResultSize'),"
        " s.conf.get('spark.sql.ansi.enabled'), s.conf.get('spark.sql.session.timeZone'),"
        " ','.join(sorted(_jvm_flags(s))), _archive_mapped(s))"
    )
    done = subprocess.run(
        [sys.executable, "-c", f"from tests.spark.test_session_settings import _archive_mapped, _jvm_flags; {probe}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    flags = "-XX:ReservedCodeCacheSize=256m,-XX:TieredStopAtLevel=1"  # a JVM for one command: C1 (crag.spark)
    # `make install` writes the class-data archive; the JVM maps it (one it could not use, it would not)
    archive = str(class_archive(SparkConfig()).exists())
    assert done.stdout.split() == [
        "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "123m",
        "false",
        "UTC",
        flags,
        archive,
    ], done.stderr[-2000:]


def _jvm_flags(session) -> set[str]:
    """The JIT flags the session's JVM was started with."""
    arguments = session.sparkContext._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments()
    return {str(a) for a in arguments if "Tiered" in str(a) or "CodeCache" in str(a)}


def _archive_mapped(session) -> bool:
    """Whether the session's JVM has the class-data archive crag.spark names mapped into its memory."""
    pid = session.sparkContext._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getPid()
    return str(class_archive(SparkConfig())) in Path(f"/proc/{pid}/maps").read_text()


def test_a_session_of_hundreds_of_runs_keeps_the_c2_compiler(spark):
    """The tests' shared session (tiered_jit): no C1-only flags; `crag spark start`'s server has them."""
    assert _jvm_flags(spark) == set()
    assert _archive_mapped(spark) == class_archive(SparkConfig()).exists()

    assert [a for a in server_command(15002, SparkConfig()) if "TieredStopAtLevel=1" in a]


def test_a_running_session_takes_runtime_settings_and_refuses_a_static_one_with_one_line(spark):
    before = spark.conf.get("spark.sql.ansi.enabled")
    try:
        _with_runtime_settings(spark, {"spark.sql.ansi.enabled": "false" if before == "true" else "true"})
        assert spark.conf.get("spark.sql.ansi.enabled") != before
    finally:
        spark.conf.set("spark.sql.ansi.enabled", before)
    with pytest.raises(ConfigError) as refused:
        _with_runtime_settings(spark, {"spark.executor.memory": "3g"})
    said = str(refused.value)
    assert said.startswith("spark.conf spark.executor.memory: the running Spark session does not take it (")
    assert "\n" not in said and "a static setting is set where the cluster or server starts" in said


def test_a_missing_schema_is_said_or_created_when_the_config_asks(spark):
    schema = "crag_test_made_45"
    spark.sql(f"DROP SCHEMA IF EXISTS spark_catalog.{schema} CASCADE")
    with pytest.raises(InputError) as missing:
        ensure_schema(spark, "spark_catalog", schema, create=False)
    assert str(missing.value) == (
        f"warehouse spark_catalog.{schema}: catalog spark_catalog has no schema {schema}: create it "
        f"(CREATE SCHEMA `spark_catalog`.`{schema}`), or set tables.create_schema=true and crag creates it"
    )
    try:
        ensure_schema(spark, "spark_catalog", schema, create=True)
        assert spark.catalog.databaseExists(f"spark_catalog.{schema}")
        ensure_schema(spark, "spark_catalog", schema, create=False)  # there now
    finally:
        spark.sql(f"DROP SCHEMA IF EXISTS spark_catalog.{schema} CASCADE")


def test_a_catalog_the_session_does_not_have_is_named_not_taken_for_a_schema(spark):
    """Spark would read `nocat`.`x` as a two-part schema of its own catalog."""
    for create in (False, True):
        with pytest.raises(
            InputError,
            match="Spark session has no catalog 'nocat_45' \\(it has spark_catalog\\): for a local folder, give ./nocat_45.x",
        ):
            ensure_schema(spark, "nocat_45", "x", create=create)
