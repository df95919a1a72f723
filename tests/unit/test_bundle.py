"""The Databricks bundle: development deploys are per user and production ones single and permissioned,
the endpoint defaults live only in conf/databricks.yaml, and the jobs and their parameter lists are
valid. (Validated against the official schema, and each job's script run as its task: tests/slow and
tests/spark/test_bundle_jobs.py.)"""

import re
import subprocess

import pytest
import yaml

from tests.support import (
    BUNDLE,
    BUNDLE_FILES,
    BUNDLE_JOBS,
    BUNDLE_RESOURCES,
    REPO,
    crag_run_args,
    job_script,
)

REFERENCE = re.compile(r"\$\{([\w.]+)\}")


@pytest.mark.parametrize("name", sorted(BUNDLE_JOBS))
def test_each_job_is_a_valid_job_definition(name):
    from databricks.bundles.jobs import Job

    job = Job.from_dict(BUNDLE_JOBS[name])  # raises on unknown fields
    assert job.tasks and job.tasks[0].spark_python_task.python_file == f"../jobs/{name}.py"
    assert job_script(name).is_file()


def test_the_job_scripts_are_uploaded_with_the_bundle():
    """The bundle syncs every file git does not ignore, less its `sync.exclude`: jobs/ must be among them."""
    scripts = [str(job_script(name)) for name in BUNDLE_JOBS]
    ignored = subprocess.run(["git", "check-ignore", *scripts], cwd=REPO, capture_output=True, text=True)
    assert ignored.returncode == 1, f"git ignores {ignored.stdout}"  # 1: none of them is ignored
    assert not any("jobs" in pattern for pattern in BUNDLE.get("sync", {}).get("exclude", []))


def test_every_variable_and_resource_used_is_declared():
    declared = set(BUNDLE["variables"])
    used = {m for f in BUNDLE_FILES for m in re.findall(r"\$\{var\.(\w+)\}", f.read_text())}
    assert used <= declared and used
    referenced = {
        tuple(m.split(".")[1:3]) for f in BUNDLE_FILES for m in re.findall(r"\$\{(resources\.[\w.]+)\}", f.read_text())
    }
    assert referenced and all(name in BUNDLE_RESOURCES.get(kind, {}) for kind, name in referenced)


def _short_name(user: str) -> str:
    """The CLI's workspace.current_user.short_name: the user name before '@', other characters than
    letters and digits as '_'."""
    return re.sub(r"[^A-Za-z0-9]", "_", user.split("@")[0])


def _resolve(target: str, user: str, **var):
    """The bundle as the CLI resolves it for `target` and `user`: variables (`var` as given with --var,
    then target values, then defaults) and references to the workspace, the bundle and its schema and volumes. Development mode
    prefixes the schema resource's name with dev_<short name>_ (the CLI's apply-presets step);
    ${workspace.file_path} is left as is."""
    spec = BUNDLE["targets"][target]
    variables = {name: v.get("default") for name, v in BUNDLE["variables"].items()} | spec.get("variables", {}) | var
    values = {
        "workspace.current_user.userName": user,
        "workspace.current_user.short_name": _short_name(user),
        "bundle.name": BUNDLE["bundle"]["name"],
        "bundle.target": target,
    }

    def resolve(value):
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v) for v in value]
        if not isinstance(value, str):
            return value
        whole = REFERENCE.fullmatch(value)
        if whole and whole.group(1).startswith("var.") and not isinstance(variables[whole.group(1)[4:]], str):
            return variables[whole.group(1)[4:]]  # a reference on its own keeps its type (a bool stays a bool)
        for _ in range(10):  # references inside references

            def one(m):
                ref = m.group(1)
                if ref.startswith("var."):
                    return str(variables[ref[4:]])
                if ref.startswith("resources."):
                    _, kind, name, field = ref.split(".")
                    return resolved_resources[kind][name][field]
                return values.get(ref, m.group(0))

            value, previous = REFERENCE.sub(one, value), value
            if value == previous:
                break
        return value

    resolved_resources = {"schemas": {}, "volumes": {}}
    for name, schema in BUNDLE_RESOURCES["schemas"].items():
        schema = resolve(schema)
        if spec.get("mode") == "development":
            schema["name"] = f"dev_{_short_name(user)}_{schema['name']}"
        resolved_resources["schemas"][name] = schema
    resolved_resources["volumes"] = {name: resolve(v) for name, v in BUNDLE_RESOURCES["volumes"].items()}
    return resolve(variables), resolved_resources, resolve(BUNDLE_JOBS), resolve(spec)


def _volume_paths(jobs) -> list[str]:
    return [
        p["default"]
        for job in jobs.values()
        for p in job.get("parameters", [])
        if str(p["default"]).startswith("/Volumes/")
    ]


@pytest.mark.parametrize("user", ["alice@example.com", "bob.smith@example.com"])
def test_development_deploys_write_to_the_users_own_schema(user):
    variables, resources, jobs, spec = _resolve("dev", user)
    schema = f"main.dev_{_short_name(user)}_crag"
    assert variables["warehouse"] == schema and variables["questions_table"] == f"{schema}.questions"
    volumes = {
        v["name"]: f"/Volumes/{v['catalog_name']}/{v['schema_name']}/{v['name']}" for v in resources["volumes"].values()
    }
    assert {"documents", "reports"} <= set(volumes)
    assert all(v["catalog_name"] + "." + v["schema_name"] == schema for v in resources["volumes"].values())
    paths = _volume_paths(jobs)
    assert len(paths) == 3 and all(any(p.startswith(v + "/") or p == v for v in volumes.values()) for p in paths)
    overrides = dict(item.split("=", 1) for item in variables["overrides"].split(";") if item)
    assert overrides["retriever.source_table"].startswith(schema + ".") and overrides[
        "retriever.index_name"
    ].startswith(schema + ".")
    assert overrides["mlflow.experiment"].startswith(f"/Users/{user}/")
    tasks = [" ".join(job["tasks"][0]["spark_python_task"]["parameters"]) for job in jobs.values()]
    assert sum(f"--warehouse {schema} " in t for t in tasks) == 2
    assert spec["mode"] == "development" and "permissions" not in spec


def test_two_developers_share_nothing():
    (a, _, ja, _), (b, _, jb, _) = _resolve("dev", "alice@example.com"), _resolve("dev", "bob@example.com")
    assert a["warehouse"] != b["warehouse"] and not set(_volume_paths(ja)) & set(_volume_paths(jb))
    assert a["overrides"] != b["overrides"]


def test_production_is_one_permissioned_copy_in_the_shared_schema():
    variables, resources, jobs, spec = _resolve("prod", "deployer@example.com")
    assert variables["warehouse"] == "main.crag" and spec["mode"] == "production"
    # one copy, whoever deploys: root_path is set explicitly (the CLI refuses production mode without it)
    assert spec["workspace"]["root_path"] == "/Workspace/Users/deployer@example.com/.bundle/crag/prod"
    levels = {(p.get("user_name") or p.get("group_name")): p["level"] for p in spec["permissions"]}
    assert levels["deployer@example.com"] == "CAN_MANAGE" and levels[variables["team_group"]] in ("CAN_VIEW", "CAN_RUN")
    assert all(p.startswith("/Volumes/main/crag/") for p in _volume_paths(jobs))
    # the team's data outlives a `bundle destroy`; a developer's does not
    kept = [r["lifecycle"]["prevent_destroy"] for kind in ("schemas", "volumes") for r in resources[kind].values()]
    assert len(kept) == 4 and all(k is True for k in kept)
    _, dev_resources, _, _ = _resolve("dev", "alice@example.com")
    assert not any(
        r["lifecycle"]["prevent_destroy"] for kind in ("schemas", "volumes") for r in dev_resources[kind].values()
    )


def test_endpoint_defaults_are_written_once_in_the_config():
    """conf/databricks.yaml holds the endpoint and index defaults (${ENV:-default}); the bundle repeats
    none of them and passes only what it decides itself (its tables, the experiment, `settings`)."""
    conf = (REPO / "conf" / "databricks.yaml").read_text()
    defaults = {d for d in re.findall(r"\$\{[A-Z_]+:-([^}]+)\}", conf) if d.strip()}
    assert {"crag-vector-search", "crag-batch-grader", "databricks-bge-m3"} <= defaults
    bundle_text = "\n".join(f.read_text() for f in BUNDLE_FILES)
    assert [d for d in defaults if d in bundle_text] == []
    overrides = BUNDLE["variables"]["overrides"]["default"]
    assert {item.split("=", 1)[0] for item in overrides.split(";") if "=" in item} == {
        "retriever.source_table",
        "retriever.index_name",
        "mlflow.experiment",
    }


def test_the_bundle_overrides_load_with_the_production_config():
    """The resolved overrides string, as a job passes it, loads with conf/databricks.yaml: the bundle's
    tables replace the config's, the endpoints stay the config's defaults, and `settings` adds keys."""
    from crag.cli import _overrides, parser
    from crag.config import load_config

    conf = str(REPO / "conf" / "databricks.yaml")
    for settings in ("", "generator.endpoint=my-chat;routing.max_relevant_docs=3"):
        variables, *_ = _resolve("dev", "alice@example.com", settings=settings)
        args = parser().parse_args(crag_run_args("w", "--overrides", variables["overrides"], questions="q", conf=conf))
        cfg = load_config(conf, _overrides(args))
        assert cfg.retriever.source_table == "main.dev_alice_crag.chunks"
        assert cfg.retriever.index_name == "main.dev_alice_crag.chunks_index"
        assert (
            cfg.retriever.endpoint == "crag-vector-search" and cfg.mlflow.experiment == "/Users/alice@example.com/crag"
        )
        assert cfg.generator.endpoint == ("my-chat" if settings else load_config(conf).generator.endpoint)
        assert cfg.routing.max_relevant_docs == (3 if settings else 5)


def test_the_schedule_is_paused_in_development():
    """Development mode pauses only a schedule whose pause_status is not set (the CLI's apply-presets
    step): a job that sets one keeps it in every target."""
    bundle = yaml.safe_load((REPO / "databricks.yml").read_text())
    assert bundle["targets"]["dev"]["mode"] == "development" and bundle["targets"]["prod"]["mode"] == "production"
    assert BUNDLE_JOBS["crag_batch"]["schedule"]["quartz_cron_expression"] == "${var.schedule_cron}"
    for name, job in BUNDLE_JOBS.items():
        for trigger in ("schedule", "trigger", "continuous"):
            assert "pause_status" not in job.get(trigger, {}), (name, trigger)
    for target in bundle["targets"].values():  # nor does a target set it for development
        assert "resources" not in target or "jobs" not in target["resources"]


def test_workspace_paths_are_the_bundles_own_variables():
    """${workspace.file_path} already starts with /Workspace: a "/Workspace${workspace.file_path}" is
    rewritten by the CLI with a warning at every validate and deploy."""
    text = "\n".join(p.read_text() for p in [REPO / "databricks.yml", *(REPO / "resources").glob("*.yml")])
    assert "${workspace.file_path}" in text
    assert not re.search(r"/Workspace/?\$\{workspace\.(root|file|artifact|state|resource)_path\}", text)
