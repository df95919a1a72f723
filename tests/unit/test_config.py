"""crag.config: the embedded defaults, variants and --set layered over a file, validation with one-line
errors, and stored configs masked. Robustness: hostile YAML, numbers that are not numbers, variant names,
Spark's local master, and the policy of an endpoint that several roles share."""

from __future__ import annotations

import os
import re
import shutil
import typing
from types import SimpleNamespace

import pytest
import yaml

from crag.cli import main
from crag.config import (
    MAX_YAML_VALUES,
    CragConfig,
    EndpointPolicy,
    LanguageCalibration,
    SemanticLanguages,
    SparkConfig,
    load_config,
    redacted,
    safe_yaml,
)
from crag.errors import ConfigError
from crag.spark import local_master, parallelism
from tests.support import LOCAL_CONF, REPO


def test_local_conf_is_valid_and_matches_defaults_where_it_should():
    cfg = load_config(LOCAL_CONF)
    assert cfg.retriever.k == 10 and cfg.routing.max_relevant_docs == 5 and cfg.web_search.k == 3
    assert cfg.routing.policy == "any_irrelevant"


def test_every_key_of_local_conf_is_commented():
    lines = [line for line in LOCAL_CONF.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    uncommented = [line for line in lines if "#" not in line and not line.rstrip().endswith(":")]
    assert uncommented == []


def test_set_overrides_parse_yaml_values():
    cfg = load_config(
        LOCAL_CONF,
        [
            "routing.policy=thresholds",
            "retriever.k=4",
            "web_search.grade_results=false",
            "rewriter.policy_keywords=[AQ-7, Hoshi]",
        ],
    )
    assert cfg.routing.policy == "thresholds" and cfg.retriever.k == 4
    assert cfg.web_search.grade_results is False and cfg.rewriter.policy_keywords == ["AQ-7", "Hoshi"]


def test_unknown_key_names_key_and_allowed_keys():
    with pytest.raises(ConfigError) as err:
        load_config(LOCAL_CONF, ["retriever.kk=3"])
    assert "retriever.kk" in str(err.value) and "backend, index, k" in str(err.value)


def test_unknown_section():
    with pytest.raises(ConfigError, match="unknown config key 'retreiver'"):
        load_config(None, ["retreiver.k=3"])


def test_unknown_backend_lists_allowed_values():
    with pytest.raises(ConfigError) as err:
        load_config(LOCAL_CONF, ["grader.backend=gpt"])
    assert "grader.backend" in str(err.value) and "'lexical'" in str(err.value)


def test_wrong_type():
    with pytest.raises(ConfigError, match="retriever.k"):
        load_config(LOCAL_CONF, ["retriever.k=many"])


def test_the_lexical_signals_need_a_weight_and_the_last_resort_a_relevance():
    with pytest.raises(ConfigError, match="grader.signals.*at least one of terms, phrases and title"):
        load_config(LOCAL_CONF, ["grader.signals.terms=0", "grader.signals.phrases=0", "grader.signals.title=0"])
    with pytest.raises(ConfigError, match="routing.last_resort"):
        load_config(LOCAL_CONF, ["routing.last_resort=1.5"])
    assert load_config(LOCAL_CONF, ["routing.last_resort=null"]).routing.last_resort is None


def test_thresholds_must_be_ordered():
    with pytest.raises(ConfigError, match="must not exceed"):
        load_config(LOCAL_CONF, ["routing.lower=0.9", "routing.upper=0.2"])


def test_bad_set_syntax():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(LOCAL_CONF, ["retriever.k"])


def test_a_set_value_of_undecodable_bytes_is_one_line(capsys):
    """Bytes of an argument that are not UTF-8 reach Python as lone surrogates, which libyaml cannot
    take: one line that names the key, not a traceback, and not the value (it may be a credential)."""
    from crag.cli import main

    assert main(["ask", "--conf", str(LOCAL_CONF), "--set", "grader.threshold=\udcff\udcfe", "q?"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("crag: error: --set grader.threshold: its value is not valid YAML (not valid UTF-8)")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("retriever: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just text\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar)


def test_variant_overlay(tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text("routing:\n  policy: any_irrelevant\n  upper: 0.7\n")
    (tmp_path / "variants").mkdir()
    (tmp_path / "variants" / "strict.yaml").write_text("routing:\n  policy: thresholds\n")
    cfg = load_config(conf, variant="strict")
    assert cfg.routing.policy == "thresholds" and cfg.routing.upper == 0.7
    with pytest.raises(ConfigError, match="unknown variant 'nope'.*known: strict"):
        load_config(conf, variant="nope")


def test_hash_changes_with_config():
    assert CragConfig().hash() == CragConfig().hash()
    assert CragConfig().hash() != load_config(None, ["retriever.k=3"]).hash()


def test_redaction_hides_secrets_but_keeps_env_var_names():
    out = redacted({"llm": {"api_key": "sk-123", "api_key_env": "OPENAI_API_KEY", "token": "", "k": 3}})
    assert out == {"llm": {"api_key": "***", "api_key_env": "OPENAI_API_KEY", "token": "", "k": 3}}


def test_bundled_variant_overlays_local_conf():
    cfg = load_config(LOCAL_CONF, variant="paper_thresholds")
    assert cfg.routing.policy == "thresholds" and cfg.retriever.k == 10


def test_env_interpolation(monkeypatch, tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text("retriever:\n  index: ${KB_DIR:-/default/kb}\nweb_search:\n  index: ${WEB_DIR}\n")
    monkeypatch.setenv("WEB_DIR", "/w")
    cfg = load_config(conf)
    assert (cfg.retriever.index, cfg.web_search.index) == ("/default/kb", "/w")
    monkeypatch.delenv("WEB_DIR")
    with pytest.raises(ConfigError, match=r"'web_search.index' refers to \$\{WEB_DIR\}, which is not set"):
        load_config(conf)


def test_role_without_backend_gets_the_embedded_one():
    assert load_config(None, ["grader.threshold=0.4"]).grader.backend == "lexical"


def test_missing_prompt_file_is_named(tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text("grader:\n  backend: openai\n  endpoint: m\n")
    with pytest.raises(ConfigError, match="'grader.prompt': prompt template not found: .*prompts/grade_binary.yaml"):
        load_config(conf)


def test_a_config_shipped_with_crag_is_found_by_name_from_any_folder(tmp_path, monkeypatch):
    """An installed wheel has no conf/ folder beside the caller: --conf NAME loads the shipped config,
    and its variants and prompts come from beside it."""
    from tests.support import REPO

    monkeypatch.chdir(tmp_path)
    assert load_config("local").model_dump() == load_config(LOCAL_CONF).model_dump()
    cfg = load_config("databricks.yaml", variant="paper_thresholds")
    assert cfg.retriever.backend == "databricks_vector_search" and cfg.routing.policy == "thresholds"
    assert cfg.grader.prompt_text == (REPO / "conf" / "prompts" / "grade_binary.yaml").read_text(encoding="utf-8")
    assert load_config("local", variant="semantic").grader.backend == "semantic"
    # a file of that name wins over the shipped config
    (tmp_path / "local.yaml").write_text("grader:\n  threshold: 0.25\n")
    assert load_config("local.yaml").grader.threshold == 0.25
    with pytest.raises(
        ConfigError,
        match=r"config file not found: nightly \(nor is it the name of a config shipped "
        r"with crag: databricks, local, openai\)",
    ):
        load_config("nightly")
    with pytest.raises(ConfigError, match="config file not found: conf/local.yaml$"):  # a path is only ever a path
        load_config("conf/local.yaml")


@pytest.mark.parametrize(
    "variant, model", [("semantic", "multilingual-e5-small"), ("semantic_use", "use-multilingual-v3")]
)
def test_the_semantic_grader_gets_the_weights_fitted_for_its_model(variant, model):
    """Cosines of two models are on different scales: one model's weights on the other's cosines would
    grade silently wrong, so a language the config does not calibrate gets its own model's weights."""
    from crag.config import FITTED_WEIGHTS

    cfg = load_config(LOCAL_CONF, [], variant)
    assert cfg.grader.embedding == cfg.indexing.embedding == model
    assert cfg.grader.languages == SemanticLanguages(**FITTED_WEIGHTS[model])
    assert FITTED_WEIGHTS["multilingual-e5-small"] != FITTED_WEIGHTS["use-multilingual-v3"]
    # switching the model alone switches the weights; a calibrated language keeps its own
    switched = load_config(
        LOCAL_CONF,
        [
            "grader.backend=semantic",
            f"grader.embedding={model}",
            "grader.languages.en.lexical=1",
            "grader.languages.en.semantic=2",
            "grader.languages.en.bias=-3",
        ],
    ).grader.languages
    # a calibrated language is its own whole: no question-level term it does not give
    assert switched.en == LanguageCalibration(lexical=1, semantic=2, bias=-3)
    assert switched.ja == LanguageCalibration(**FITTED_WEIGHTS[model]["ja"])
    # the answer weight is the logit over the lexical weight: none at or below 0
    with pytest.raises(ConfigError, match=r"^config key 'grader.languages.en.lexical': Input should be greater than 0"):
        load_config(
            LOCAL_CONF,
            ["grader.languages.en.lexical=0", "grader.languages.en.semantic=2", "grader.languages.en.bias=-3"],
        )


def test_a_variant_that_switches_a_backend_leaves_the_replaced_backends_keys_behind(tmp_path):
    """A config whose grader is semantic, with `embedding`; a variant that switches to the lexical
    grader, which has no such key, loads. A key the variant itself gives is still checked."""
    cfg = load_config(LOCAL_CONF, [], "semantic_use")
    assert cfg.grader.backend == "semantic" and cfg.indexing.embedding == "use-multilingual-v3"
    assert load_config(LOCAL_CONF, ["grader.backend=lexical"], "semantic").grader.backend == "lexical"
    conf = tmp_path / "local.yaml"
    semantic = "  backend: semantic\n  embedding: use-multilingual-v3\n"
    text = re.sub(r"(?m)^  backend: lexical .*\n", semantic, LOCAL_CONF.read_text(encoding="utf-8"), count=1)
    conf.write_text(text, encoding="utf-8")
    assert load_config(conf).grader.backend == "semantic"
    (tmp_path / "variants").mkdir()
    (tmp_path / "variants" / "mine.yaml").write_text("grader:\n  backend: lexical\n  embedding: none\n")
    with pytest.raises(ConfigError, match="unknown config key 'grader.embedding'"):
        load_config(conf, [], "mine")


def test_a_set_that_switches_a_backend_leaves_the_replaced_backends_keys_behind():
    """conf/local.yaml's web_search has `index` (the offline collection's); --set web_search.backend=none
    must not fail on it. A key a --set itself gives is still checked."""
    assert load_config(LOCAL_CONF, ["web_search.backend=none"]).web_search.backend == "none"
    with pytest.raises(ConfigError, match="unknown config key 'web_search.indx'"):
        load_config(LOCAL_CONF, ["web_search.backend=none", "web_search.indx=1"])
    with pytest.raises(ConfigError, match="unknown config key 'web_search.index'"):
        load_config(None, ["web_search.backend=none", "web_search.index=x"])
    switched = ["grader.backend=openai", "grader.endpoint=m"]  # lexical in the file: its exponents go
    assert load_config(LOCAL_CONF, [*switched, "grader.policy.timeout_s=5"]).grader.policy.timeout_s == 5
    with pytest.raises(ConfigError, match="unknown config key 'grader.polcy'"):
        load_config(LOCAL_CONF, [*switched, "grader.polcy.x=1"])


def test_a_set_of_the_backend_a_section_has_drops_nothing(tmp_path):
    """A mistyped key of the file is no other backend's: it fails whatever --set says."""
    import shutil

    shutil.copytree(LOCAL_CONF.parent / "prompts", tmp_path / "prompts")
    conf = tmp_path / "typo.yaml"
    conf.write_text(LOCAL_CONF.read_text().replace("grader:\n", "grader:\n  threshhold: 0.9\n", 1))
    for sets in ([], ["grader.backend=lexical"], ["grader.backend=openai", "grader.endpoint=m"]):
        with pytest.raises(ConfigError, match="unknown config key 'grader.threshhold'"):
            load_config(conf, sets)


def test_spark_settings_are_one_dotted_key_each_from_yaml_or_set(tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text(
        "spark:\n  conf:\n    spark.sql.catalog.lake: org.example.Catalog\n    spark.sql.ansi.enabled: true\n"
    )
    cfg = load_config(
        conf, ["spark.conf.spark.sql.catalog.lake.uri=http://h:1/x", "spark.conf.spark.executor.memory=2g"]
    )
    assert cfg.spark.conf == {
        "spark.sql.catalog.lake": "org.example.Catalog",
        "spark.sql.ansi.enabled": "true",  # YAML's boolean, as Spark spells it
        "spark.sql.catalog.lake.uri": "http://h:1/x",
        "spark.executor.memory": "2g",
    }


@pytest.mark.parametrize(
    ("override", "said"),
    [
        (
            "spark.conf.spark.sql.session.timeZone=PST",
            "spark.sql.session.timeZone is set by crag (crag's tables hold UTC times)",
        ),
        ("spark.conf.spark.jars=/x.jar", "spark.jars is set by crag (the Delta Lake jars: set spark.jars_dir)"),
        (
            "spark.conf.spark.sql.catalog.spark_catalog=x",
            "spark.sql.catalog.spark_catalog is set by crag (Delta Lake's catalog)",
        ),
        ("spark.conf.spark.master=local[9]", "spark.master is set by crag (set spark.master)"),
        ("spark.conf.spark.connect.grpc.binding.port=1", "is set by crag (Spark Connect's wiring"),
        ("spark.conf.sql.shuffle.partitions=8", "sql.shuffle.partitions: a Spark setting's name starts with 'spark.'"),
        ("spark.conf={spark: {sql: 1}}", "spark: a Spark setting takes one value"),
        ("spark.sql.catalog.x=y", "a Spark setting is given as spark.conf.spark.…"),
    ],
)
def test_a_spark_setting_crag_owns_or_misspelt_is_refused_with_one_line(override, said):
    with pytest.raises(ConfigError, match=None) as refused:
        load_config(None, [override])
    assert said in str(refused.value) and "\n" not in str(refused.value)


def test_every_setting_crag_gives_a_local_session_is_one_spark_conf_refuses():
    from crag.config import CRAG_SPARK_SETTINGS
    from crag.spark import LOCAL_SETTINGS

    assert set(LOCAL_SETTINGS) <= set(CRAG_SPARK_SETTINGS)


def test_the_spark_connect_deadline_is_a_positive_duration():
    assert load_config(None, ["spark.connect_timeout_s=2.5"]).spark.connect_timeout_s == 2.5
    for bad in ("0", "-1", ".inf", "true", "100000"):
        with pytest.raises(ConfigError, match="spark.connect_timeout_s"):
            load_config(None, [f"spark.connect_timeout_s={bad}"])


# ---------------------------------------------------------------- robustness

DBX = REPO / "conf" / "databricks.yaml"


def _write(tmp_path, text: str, name: str = "c.yaml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _bomb(levels: int, width: int) -> str:
    lines = [f"l0: &l0 [{', '.join(['x'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_before_it_is_expanded(tmp_path):
    path = _write(tmp_path, _bomb(levels=9, width=9))  # 9**9 values once expanded: a "billion laughs"
    with pytest.raises(
        ConfigError, match=f"is not valid YAML: aliases expand it to more than {MAX_YAML_VALUES} values"
    ):
        load_config(path)


def test_an_alias_bomb_in_a_prompt_template_is_refused(tmp_path):
    shutil.copytree(REPO / "conf" / "prompts", tmp_path / "prompts")
    (tmp_path / "prompts" / "bomb.yaml").write_text(_bomb(9, 9) + "system: s\nuser: u\n", encoding="utf-8")
    conf = _write(tmp_path, "generator: {backend: openai, endpoint: m, prompt: prompts/bomb.yaml}\n")
    from crag.backends.llm_roles import LLMGenerator

    class Model:  # never called: the template is refused first
        name, concurrency = "m", 1

    cfg = load_config(conf).generator
    with pytest.raises(ConfigError, match="not valid YAML"):
        LLMGenerator(Model(), cfg)


@pytest.mark.parametrize(
    "text",
    [
        "spark: &s\n  master: *s\n",  # a mapping that contains itself
        "a: &a [1, *a]\n",  # a list that contains itself
    ],
)
def test_a_self_referencing_alias_is_one_line(tmp_path, text):
    with pytest.raises(ConfigError, match="an alias refers to the value that contains it"):
        load_config(_write(tmp_path, text))


@pytest.mark.parametrize(
    "depth",
    [
        900,  # within libyaml's limit: crag's own walk over the values reaches Python's recursion limit
        20000,  # past libyaml's limit of 1,000 levels: its scanner refuses the document
    ],
)
def test_nesting_too_deep_is_one_line(tmp_path, depth):
    with pytest.raises(ConfigError, match=r"is not valid YAML: (nested too deeply|exceeded maximum nesting depth)"):
        load_config(_write(tmp_path, "a: " + "[" * depth + "]" * depth + "\n"))


def test_modest_aliases_still_work(tmp_path):
    text = "grader: {threshold: 0.4}\nx-policy: &p {max_concurrency: 3, timeout_s: 7}\n"
    assert safe_yaml(text)["x-policy"]["timeout_s"] == 7
    shared = "retriever: {k: 4}\nrouting: &r {policy: thresholds, upper: 0.7, lower: 0.2}\n"
    data = safe_yaml(shared)
    assert data["routing"] == {"policy": "thresholds", "upper": 0.7, "lower": 0.2}


def test_a_repeated_key_is_an_error_not_a_silently_lost_section(tmp_path, capsys):
    # PyYAML keeps the second `retriever:` and drops the first: its k and index would be lost.
    text = "retriever:\n  k: 4\ngrader:\n  threshold: 0.4\nretriever:\n  top_parents: 2\n"
    with pytest.raises(ConfigError, match="is not valid YAML: a key on line 5 repeats the key on line 1"):
        load_config(_write(tmp_path, text))
    with pytest.raises(ConfigError, match="a key on line 3 repeats the key on line 2"):
        load_config(_write(tmp_path, "grader:\n  threshold: 0.4\n  threshold: 0.6\n"))
    assert main(["ask", "--conf", str(_write(tmp_path, "a: 1\na: 2\n")), "q?"]) == 2
    err = capsys.readouterr().err
    assert "a key on line 2 repeats the key on line 1" in err and err.count("\n") == 1
    # a merge key (<<) may be repeated, and keys equal only in a nested mapping are not repeated
    merged = safe_yaml("p: &p {k: 1}\nq: &q {j: 2}\nr:\n  <<: *p\n  <<: *q\ns: {k: 1}\n")
    assert merged["r"] == {"k": 1, "j": 2}
    # keys are equal as PyYAML builds them: a number and the same digits quoted are two keys ...
    for distinct in ('1: a\n"1": b\n', 'true: a\n"true": b\n', "!!str 1: a\n1: b\n"):
        assert len(safe_yaml(distinct)) == 2
    # ... while spellings of one value are one key, which PyYAML would silently keep once
    for repeated in ("true: a\nyes: b\n", "null: a\n~: b\n", "1: a\n0x1: b\n"):
        with pytest.raises(yaml.YAMLError, match="a key on line 2 repeats the key on line 1$"):
            safe_yaml(repeated)
    with pytest.raises(yaml.YAMLError, match=r"line 1 \(column 11\) repeats the key on line 1 \(column 5\)"):
        safe_yaml("x: {a: 1, a: 2}\n")  # two on one line (a --set value): the columns tell them apart


def test_a_prompt_template_with_a_repeated_key_is_refused(tmp_path):
    shutil.copytree(REPO / "conf" / "prompts", tmp_path / "prompts")
    (tmp_path / "prompts" / "twice.yaml").write_text("system: s $question\nuser: u\nuser: $context\n", encoding="utf-8")
    conf = _write(tmp_path, "generator: {backend: openai, endpoint: m, prompt: prompts/twice.yaml}\n")
    from crag.backends.llm_roles import LLMGenerator

    class Model:  # never called: the template is refused first
        name, concurrency = "m", 1

    with pytest.raises(ConfigError, match="a key on line 3 repeats the key on line 2"):
        LLMGenerator(Model(), load_config(conf).generator)


def test_the_cli_prints_one_line_for_a_bomb(tmp_path, capsys):
    path = _write(tmp_path, _bomb(9, 9))
    assert main(["ask", "--conf", str(path), "q?"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("crag: error: config file") and err.count("\n") == 1


@pytest.mark.parametrize(
    "override, message",
    [
        ("retriever.k=true", "config key 'retriever.k': a boolean is not a number (got True)"),
        ("routing.max_relevant_docs=false", "config key 'routing.max_relevant_docs': a boolean is not a number"),
        ("grader.threshold=true", "config key 'grader.threshold': a boolean is not a number"),
        ("spark.partitions=true", "config key 'spark.partitions': a boolean is not a number"),
        ("grader.threshold=.nan", "config key 'grader.threshold': Input should be a finite number"),
        ("routing.upper=.inf", "config key 'routing.upper': Input should be a finite number"),
        (
            "generator.min_sentence_score=-.inf",
            "config key 'generator.min_sentence_score': Input should be a finite number",
        ),
    ],
)
def test_numbers_must_be_finite_numbers(index_overrides, override, message):
    with pytest.raises(ConfigError) as caught:
        load_config(LOCAL_CONF, [*index_overrides, override])
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("retriever.policy.timeout_s=.inf", "Input should be a finite number"),
        ("retriever.policy.timeout_s=1e300", "less than or equal to 86400"),
        ("grader.policy.timeout_s=100000", "less than or equal to 86400"),
        ("grader.policy.backoff_max_s=1e12", "less than or equal to 86400"),
        ("grader.policy.max_attempts=true", "a boolean is not a number"),
        ("generator.temperature=false", "a boolean is not a number"),
        ("generator.max_tokens=true", "a boolean is not a number"),
        ("web_search.policy.max_concurrency=.nan", "max_concurrency"),
    ],
)
def test_endpoint_policies_are_bounded(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DBX, [override])


def test_a_day_long_timeout_is_allowed():
    assert load_config(DBX, ["grader.policy.timeout_s=86400"]).grader.policy.timeout_s == 86400


def test_the_whole_timeout_path_is_bounded_from_a_file(tmp_path):
    conf = _write(
        tmp_path,
        "retriever:\n  backend: databricks_vector_search\n  endpoint: e\n  index_name: a.b.c\n"
        "  policy: {timeout_s: .inf}\n",
    )
    with pytest.raises(ConfigError, match="retriever.policy.timeout_s"):
        load_config(conf)


@pytest.mark.parametrize("key", ["master", "remote"])
@pytest.mark.parametrize("master", ["local[0]", "local[-1]", "local[x]", "local[]", "local[0,2]", "local[2,0]"])
def test_a_local_master_without_threads_is_one_line(index_overrides, master, key):
    with pytest.raises(ConfigError, match=rf"config key 'spark.{key}'.*local\[N\]"):
        load_config(LOCAL_CONF, [*index_overrides, f"spark.{key}={master}"])


@pytest.mark.parametrize(
    "master", ["local", "local[1]", "local[*]", "local[4,3]", "local[*,2]", "spark://h:7077", "yarn"]
)
def test_valid_masters_pass(index_overrides, master):
    assert load_config(LOCAL_CONF, [*index_overrides, f"spark.master={master}"]).spark.master == master


@pytest.mark.parametrize(
    ("master", "started", "batch_tasks"),
    [
        ("local", "local[2]", 1),
        ("local[1]", "local[2]", 1),
        ("local[2]", "local[3]", 2),
        ("local[4,3]", "local[5,3]", 4),
    ],
)
def test_a_local_session_gets_a_slot_beyond_the_batch(master, started, batch_tasks):
    """local[N]: the batch's tasks take N slots, and the run's own commits get one more."""

    class Session:
        def __init__(self, slots):
            self.conf = {"spark.default.parallelism": str(slots)}

    spark_master, slots = local_master(master)
    assert spark_master == started
    assert parallelism(Session(slots), SparkConfig()) == batch_tasks
    assert parallelism(Session(slots), SparkConfig(partitions=7)) == 7  # spark.partitions, when set, decides


def test_only_local_masters_get_a_slot_more():
    assert local_master("spark://h:7077") is None and local_master("yarn") is None
    cores = len(os.sched_getaffinity(0))  # the cores this process may run on
    assert local_master("local[*]") == (f"local[{cores + 1}]", cores + 1)
    assert local_master("local[*,3]") == (f"local[{cores + 1},3]", cores + 1)


@pytest.mark.parametrize(
    "variant",
    [
        "../local",
        "/etc/passwd",
        "variants/paper_thresholds",
        "..",
        "a/../paper_thresholds",
        "paper_thresholds\n",
        ".hidden",
        "x\\y",
        "~/v",
        "",
    ],
)
def test_a_variant_is_a_name_not_a_path(variant):
    if variant == "":
        return  # an empty --variant means none
    with pytest.raises(ConfigError, match=r"--variant .*not a path"):
        load_config(LOCAL_CONF, [], variant)


def test_a_variant_outside_the_folder_is_never_read(tmp_path, capsys):
    conf_dir = tmp_path / "conf"
    (conf_dir / "variants").mkdir(parents=True)
    shutil.copy(LOCAL_CONF, conf_dir / "local.yaml")
    (tmp_path / "outside.yaml").write_text("routing: {policy: thresholds}\n", encoding="utf-8")
    for variant in ("../../outside", str(tmp_path / "outside")):
        assert main(["ask", "--conf", str(conf_dir / "local.yaml"), "--variant", variant, "q?"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("crag: error: --variant") and err.count("\n") == 1


def test_a_variant_by_name_still_loads():
    assert load_config(LOCAL_CONF, [], "paper_thresholds").routing.policy == "thresholds"


def test_max_tokens_is_stored_as_a_number():
    from crag.config import redacted

    stored = redacted(load_config(DBX).model_dump(mode="json"))
    assert stored["generator"]["max_tokens"] == 300
    assert stored["rewriter"]["max_tokens"] == 100


# ---------------------------------------------------------------- one endpoint, several roles


def _shared_endpoint_conf(tmp_path, kb_index: str, rewriter_policy: str, generator_policy: str):
    prompts = REPO / "conf" / "prompts"
    return _write(
        tmp_path,
        f"""
retriever: {{index: {kb_index}}}
web_search: {{backend: none}}
rewriter: {{backend: databricks, endpoint: chat, prompt: {prompts / "rewrite.yaml"}, policy: {rewriter_policy}}}
generator: {{backend: databricks, endpoint: chat, prompt: {prompts / "answer_concise.yaml"}, policy: {generator_policy}}}
""",
    )


def test_roles_sharing_an_endpoint_get_one_merged_policy(tmp_path):
    from crag.backends import shared_policies

    # as in conf/databricks.yaml: the rewriter and the generator share one chat endpoint
    conf = _shared_endpoint_conf(
        tmp_path, "kb", "{timeout_s: 60, max_concurrency: 3, max_attempts: 4}", "{timeout_s: 120, max_attempts: 2}"
    )
    [merged] = [p for key, p in shared_policies(load_config(conf)).items() if key[1] == "chat"]
    assert merged == EndpointPolicy(
        max_concurrency=8, timeout_s=120, max_attempts=4, backoff_initial_s=0.5, backoff_max_s=30
    )
    # the same whichever role sets which value
    swapped = _shared_endpoint_conf(
        tmp_path, "kb", "{timeout_s: 120, max_attempts: 2}", "{timeout_s: 60, max_concurrency: 3, max_attempts: 4}"
    )
    [again] = [p for key, p in shared_policies(load_config(swapped)).items() if key[1] == "chat"]
    assert again == merged


def test_the_shared_client_uses_the_merged_policy(tmp_path, monkeypatch, sample_indexes):
    from crag.backends import build_backends

    monkeypatch.setenv("DATABRICKS_HOST", "http://127.0.0.1:9")
    monkeypatch.setenv("DATABRICKS_TOKEN", "local-token")
    conf = _shared_endpoint_conf(tmp_path, sample_indexes["kb"], "{timeout_s: 60}", "{timeout_s: 120}")
    backends = build_backends(load_config(conf))
    assert backends.rewriter.model is backends.generator.model  # one client for the shared endpoint
    assert backends.generator.model._endpoint.policy.timeout_s == 120  # not only the first role's 60


def _models(annotation) -> list:
    """The config models a field allows: its union's members (None left out), or the one model."""
    return [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]


def _backend_names(annotation) -> set[str]:
    return {name for model in _models(annotation) for name in typing.get_args(model.model_fields["backend"].annotation)}


def test_every_backend_the_config_allows_has_a_provider_and_no_other():
    from crag.backends import PROVIDERS

    fields = CragConfig.model_fields
    allowed = {
        (role, name)
        for role in ("retriever", "grader", "rewriter", "generator", "web_search")
        for name in _backend_names(fields[role].annotation)
    }
    verify = next(m for m in _models(fields["web_search"].annotation) if "verify" in m.model_fields)
    allowed |= {("source_check", name) for name in _backend_names(verify.model_fields["verify"].annotation)}
    assert set(PROVIDERS) == allowed


def test_an_unknown_backend_name_is_one_config_error():
    from crag.backends import _Building, _provide

    with pytest.raises(
        ConfigError,
        match=r"no retriever backend 'faiss': choose one of "
        r"\['bm25', 'databricks_vector_search', 'hybrid', 'langchain'\]",
    ):
        _provide(_Building(CragConfig(), None, 1, {}), "retriever", SimpleNamespace(backend="faiss"))


def test_databricks_serving_endpoints_share_the_longest_timeout():
    """mlflow reads the request timeout from the process environment that every serving client of a
    worker process shares: a grader's 60 s must not cut off a generation allowed 120 s."""
    from crag.backends import shared_policies

    cfg = load_config(
        REPO / "conf" / "databricks.yaml", ["grader.policy.timeout_s=45", "generator.policy.timeout_s=150"]
    )
    timeouts = {key[1]: policy.timeout_s for key, policy in shared_policies(cfg).items()}
    assert timeouts == {cfg.grader.endpoint: 150, cfg.generator.endpoint: 150}
    openai = load_config(REPO / "conf" / "openai.yaml", ["grader.endpoint=small", "grader.policy.timeout_s=45"])
    assert {key[1]: p.timeout_s for key, p in shared_policies(openai).items()}["small"] == 45  # clients of their own


@pytest.mark.parametrize("conf", [LOCAL_CONF, DBX])
@pytest.mark.parametrize("message", ["''", "'...'", "'  '"])
def test_a_refusal_message_without_words_is_refused(conf, message):
    """A reply is a refusal when its words start with the refusal's words: with none, every reply is one."""
    with pytest.raises(ConfigError, match="generator.refusal_message.*must hold words"):
        load_config(conf, [f"generator.refusal_message={message}"])
    assert (
        load_config(conf, ["generator.refusal_message='わかりません。'"]).generator.refusal_message == "わかりません。"
    )


def test_a_child_overlap_as_long_as_a_chunk_is_one_line(tmp_path, capsys):
    """The splitter refuses an overlap not shorter than its chunks: the config says so first, in one line."""
    docs = _write(tmp_path, '{"doc_id": "a", "text": "alpha"}\n', "docs.jsonl")
    argv = ["index", "--conf", str(LOCAL_CONF), "--docs", str(docs), "--out", str(tmp_path / "idx")]
    assert main([*argv, "--set", "indexing.child_overlap=300"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "crag: error: config key 'indexing': Value error, "
        "indexing.child_overlap (300) must be smaller than indexing.child_chars (300)"
    )
    assert not (tmp_path / "idx").exists()


def test_a_grading_format_its_shipped_prompt_does_not_ask_for_is_refused():
    """prompts/grade_binary.yaml asks for {"grade": ...}: read as a score, every grade would be unreadable."""
    with pytest.raises(ConfigError, match="'grader.format': score, but its prompt prompts/grade_binary.yaml is crag's"):
        load_config(REPO / "conf" / "openai.yaml", ["grader.format=score"])
    fixed = load_config(
        REPO / "conf" / "openai.yaml", ["grader.format=score", "grader.prompt=prompts/grade_score.yaml"]
    )
    assert fixed.grader.format == "score" and "Score" in fixed.grader.prompt_text


def test_a_grading_prompt_of_ones_own_is_not_judged_by_its_file_name(tmp_path):
    """Only crag's own prompts (or copies of them) are known to ask for one format."""
    own = tmp_path / "grade_binary.yaml"  # a score prompt of one's own, under the shipped binary's name
    own.write_text((REPO / "conf" / "prompts" / "grade_score.yaml").read_text().replace("Reason", "Why"))
    cfg = load_config(REPO / "conf" / "openai.yaml", ["grader.format=score", f"grader.prompt={own}"])
    assert cfg.grader.format == "score"
    copy = tmp_path / "mine.yaml"  # a copy of the shipped binary prompt, renamed
    copy.write_text((REPO / "conf" / "prompts" / "grade_binary.yaml").read_text())
    with pytest.raises(ConfigError, match="is crag's grade_binary.yaml, which asks for the binary format"):
        load_config(REPO / "conf" / "openai.yaml", ["grader.format=score", f"grader.prompt={copy}"])


def test_a_text_value_with_a_colon_in_it_says_to_quote_it(index_overrides):
    with pytest.raises(ConfigError) as caught:
        load_config(LOCAL_CONF, [*index_overrides, "generator.refusal_message=I don't know: nothing."])
    assert str(caught.value) == (
        "config key 'generator.refusal_message': Input should be a valid string "
        "(got a mapping: YAML reads `a: b` as one; put the value in quotes)"
    )
    quoted = load_config(LOCAL_CONF, [*index_overrides, 'generator.refusal_message="I don\'t know: nothing."'])
    assert quoted.generator.refusal_message == "I don't know: nothing."


def test_an_empty_variant_is_an_error_not_the_base_config():
    for conf in (LOCAL_CONF, None):
        with pytest.raises(ConfigError, match=r"^--variant is empty: give a variant's name, or leave --variant out"):
            load_config(conf, [], "")


@pytest.mark.parametrize("value", ["", "'  '"])
def test_an_empty_mlflow_experiment_is_refused_when_the_config_loads(index_overrides, value):
    # MLflow itself refused it only after the run, when the run was to be logged
    with pytest.raises(ConfigError, match="config key 'mlflow.experiment': .*an MLflow experiment needs a name"):
        load_config(LOCAL_CONF, [f"mlflow.experiment={value}"])
    assert load_config(LOCAL_CONF, ["mlflow.experiment=/Shared/crag"]).mlflow.experiment == "/Shared/crag"


def test_a_refused_resume_names_the_keys_that_differ_and_only_real_ones(index_overrides):
    import json

    from crag.config import redacted
    from crag.ledger import Ledger

    def _differing_keys(previous, plan):
        return Ledger._differing_keys(plan, previous)

    def stored(cfg):
        return {"config": json.dumps(redacted(cfg.model_dump(mode="json"))), "config_hash": cfg.hash()}

    started = load_config(LOCAL_CONF, index_overrides, "paper_thresholds")
    plan = SimpleNamespace(cfg=load_config(LOCAL_CONF, [*index_overrides, "retriever.k=3"], "paper_thresholds"))
    assert _differing_keys(stored(started), plan) == ", differing in retriever.k"
    # the same config under another variant name: no key is said to differ (the line names both variants)
    spelled_out = ["routing.policy=thresholds", "routing.upper=0.6", "routing.lower=0.3"]
    plan = SimpleNamespace(cfg=load_config(LOCAL_CONF, [*index_overrides, *spelled_out]))
    assert plan.cfg.hash() == started.hash() and _differing_keys(stored(started), plan) == ""
