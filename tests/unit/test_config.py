import re

import pytest

from crag.config import CragConfig, load_config, redacted
from crag.errors import ConfigError
from tests.support import LOCAL_CONF


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
    assert cfg.grader.languages.model_dump() == FITTED_WEIGHTS[model]
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
    assert switched.en.model_dump() == {"lexical": 1, "semantic": 2, "bias": -3}
    assert switched.ja.model_dump() == FITTED_WEIGHTS[model]["ja"]


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
