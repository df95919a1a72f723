"""A local JVM's options, without a JVM: C1 alone unless the JVM keeps the tiered JIT,
and the class-data archive named by what it was made with (its use by a real JVM:
tests/spark/test_session_settings.py)."""

from __future__ import annotations

from crag.config import SparkConfig
from crag.spark import C1_ONLY, LOCAL_SETTINGS, class_archive, java_options
from crag.spark_server import server_command


def test_every_jvm_crag_starts_gets_c1_alone_unless_it_keeps_the_tiered_jit(jars_dir):
    cfg = SparkConfig(jars_dir=str(jars_dir))
    c1 = java_options(cfg)
    tiered = java_options(cfg, tiered_jit=True)
    assert c1.startswith(LOCAL_SETTINGS["spark.driver.extraJavaOptions"]) and c1.endswith(C1_ONLY)
    assert "TieredStopAtLevel" not in tiered and "ReservedCodeCacheSize" not in tiered
    assert f"spark.driver.extraJavaOptions={c1}" in server_command(15002, cfg)  # crag spark start's JVM


def test_the_archive_is_used_only_once_it_exists(jars_dir):
    cfg = SparkConfig(jars_dir=str(jars_dir))
    archive = class_archive(cfg)
    assert archive.parent == jars_dir and archive.suffix == ".jsa"
    assert "SharedArchiveFile" not in java_options(cfg)
    archive.write_bytes(b"archive")
    for tiered in (False, True):
        options = java_options(cfg, tiered_jit=tiered)
        assert f"-XX:SharedArchiveFile={archive}" in options
        assert "-Xlog:cds=off" in options  # a JVM that cannot use it says nothing on crag's console


def test_other_jars_or_another_jdk_find_no_archive_rather_than_a_stale_one(jars_dir, tmp_path, monkeypatch):
    cfg = SparkConfig(jars_dir=str(jars_dir))
    before = class_archive(cfg)
    (jars_dir / "delta-storage-4.4.0.jar").rename(jars_dir / "delta-storage-4.5.0.jar")
    other_jars = class_archive(cfg)
    assert other_jars != before
    java_home = tmp_path / "jdk"
    (java_home / "bin").mkdir(parents=True)
    (java_home / "bin" / "java").write_text("")
    monkeypatch.setenv("JAVA_HOME", str(java_home))
    assert class_archive(cfg) not in (before, other_jars)


def test_an_archive_there_already_is_not_written_again(jars_dir):
    from crag.spark_warm import write_class_archive

    cfg = SparkConfig(jars_dir=str(jars_dir))
    class_archive(cfg).write_bytes(b"archive")
    assert write_class_archive(cfg) is None  # no JVM started
    assert class_archive(cfg).read_bytes() == b"archive"
