"""The kafold.toml loader: every bad config gets an error naming the key and the file, all at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kafold import config
from kafold.errors import ConfigError
from kafold.schema import Secret
from tests.support import ROOT

EXAMPLE = ROOT / "examples" / "bank" / "kafold.toml"

AGG = """
[[aggregates]]
name = "account"
initial = "bank_domain:initial"
evolve = "bank_domain:evolve"
decide = "bank_domain:decide"
"""


def problems_of(text: str, tmp_path: Path, environ: dict[str, str] | None = None) -> list[str]:
    path = tmp_path / "kafold.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        config.parse(text, path, environ or {})
    for p in info.value.problems:
        assert p.startswith(f"{path}: "), p  # every problem names the file
    return info.value.problems


BAD = {
    "typo_key": ('[kafka]\nbootstrap_server = "x:9092"\n', "kafka.bootstrap_server",
                 "did you mean 'bootstrap_servers'"),
    "typo_section": ('[kafak]\nbootstrap_servers = "x"\n', "kafak", "did you mean 'kafka'"),
    "wrong_type": ("[daemon]\nhttp_port = \"eighty\"\n", "daemon.http_port", "expected integer"),
    "missing_required": ('[[aggregates]]\nname = "a"\ninitial = "m:i"\ndecide = "m:d"\n',
                         "aggregates[0].evolve", "missing required key"),
    "literal_secret": ('[kafka]\nsasl_password = "hunter2"\n', "kafka.sasl_password", "literal secrets are refused"),
    "password_in_url": ('[postgres]\nurl = "postgresql://u:hunter2@db/x"\n', "postgres.url", "literal password"),
    "unknown_connector": ('[[connectors]]\nname = "p"\nclass = "no-such-connector"\ntopics = ["t"]\n',
                          "connectors[0].class", "no-such-connector"),
    "not_copartitioned": (AGG + '[[topics]]\nname = "account.snapshots"\npartitions = 2\n'
                          'configs = {"cleanup.policy" = "compact"}\n',
                          "topics", "co-partitioned with 'account.events'"),
    "snapshot_not_compacted": (AGG + '[[topics]]\nname = "account.snapshots"\npartitions = 4\n'
                               'configs = {"cleanup.policy" = "delete"}\n', "topics", "cleanup.policy=compact"),
    "bad_choice": ('[kafka]\nsecurity_protocol = "TLS"\n', "kafka.security_protocol", "is not one of"),
    "below_minimum": (AGG.replace('name = "account"', 'name = "account"\npartitions = 0'),
                      "aggregates[0].partitions", "must be >= 1"),
    "bad_function_ref": (AGG.replace("bank_domain:evolve", "bank_domain.evolve"),
                         "aggregates[0].evolve", "module:function"),
    "duplicate_connector": ('[[connectors]]\nname = "a"\nclass = "log"\ntopics = ["t"]\n' * 2,
                            "connectors[1].name", "duplicate connector name"),
    "secret_env_unset": ('[kafka]\nsasl_password_env = "KAFOLD_TEST_UNSET_VAR"\n', "kafka.sasl_password_env",
                         "KAFOLD_TEST_UNSET_VAR is not set"),
    "connector_config_typo": ('[[connectors]]\nname = "a"\nclass = "log"\ntopics = ["t"]\n'
                              '[connectors.config]\nlevl = "info"\n', "connectors[0].config.levl", "unknown key"),
    "no_topics": ('[[connectors]]\nname = "a"\nclass = "log"\ntopics = []\n', "connectors[0].topics",
                  "at least one source topic"),
    "state_dir_not_a_directory": ('[daemon]\nstate_dir = "/dev/null"\n', "daemon.state_dir", "not a directory"),
    "not_toml": ("[kafka\n", "", "not valid TOML"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_config_names_the_key(name: str, tmp_path: Path) -> None:
    """Each kind of bad config yields one clear problem naming its key path."""
    text, key, message = BAD[name]
    problems = problems_of(text, tmp_path)
    assert any(f": {key}" in p and message in p for p in problems), problems


def test_all_problems_reported_at_once(tmp_path: Path) -> None:
    """Three independent mistakes are reported together, not one per run."""
    text = '[kafka]\nbootstrap_server = "x"\n[daemon]\nhttp_port = "x"\n[postgres]\npassword = "p"\n'
    problems = problems_of(text, tmp_path)
    assert len(problems) == 3, problems


def test_secret_from_env_and_file(tmp_path: Path) -> None:
    """Secrets load by reference; the value never shows in repr."""
    secret_file = tmp_path / "pg-password"
    secret_file.write_text("from-file\n")
    secret_file.chmod(0o600)
    text = ('[kafka]\nsecurity_protocol = "SASL_SSL"\nsasl_mechanism = "SCRAM-SHA-512"\nsasl_username = "u"\n'
            f'sasl_password_env = "MY_PW"\n[postgres]\npassword_file = "{secret_file}"\n')
    loaded = config.parse(text, tmp_path / "k.toml", {"MY_PW": "from-env"})
    os.environ["MY_PW"] = "from-env"
    try:
        assert isinstance(loaded.config.kafka.sasl_password, Secret)
        assert loaded.config.kafka.sasl_password.reveal() == "from-env"
        assert loaded.config.postgres.password is not None
        assert loaded.config.postgres.password.reveal() == "from-file"
        assert "from-" not in repr(loaded.config)
    finally:
        del os.environ["MY_PW"]


def test_secret_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    secret_file = tmp_path / "pw"
    secret_file.write_text("x")
    secret_file.chmod(0o644)
    problems = problems_of(f'[postgres]\npassword_file = "{secret_file}"\n', tmp_path)
    assert any("postgres.password_file" in p and "readable or writable by others" in p for p in problems)


def test_environment_overrides_keys(tmp_path: Path) -> None:
    """KAFOLD_<SECTION>__<KEY> overrides the file; a bad override names the key."""
    env = {"KAFOLD_KAFKA__BOOTSTRAP_SERVERS": "broker:9093", "KAFOLD_DAEMON__HTTP_PORT": "9000"}
    loaded = config.parse('[kafka]\nbootstrap_servers = "x:1"\n', tmp_path / "k.toml", env)
    assert loaded.config.kafka.bootstrap_servers == "broker:9093"
    assert loaded.config.daemon.http_port == 9000
    problems = problems_of("", tmp_path, {"KAFOLD_DAEMON__HTTP_PORT": "nine"})
    assert any("daemon.http_port" in p for p in problems)


def test_example_config_is_valid_and_implies_its_topics() -> None:
    loaded = config.load_file(EXAMPLE, environ={})
    topics = config.topic_map(loaded.config)
    assert {"account.events", "account.commands", "account.results", "account.snapshots",
            "kafold.dlq.accounts-log", "kafold.dlq.aggregate.account"} <= set(topics)
    assert topics["kafold.dlq.aggregate.account"].purpose == "dead-letter"
    snap = topics["account.snapshots"]
    assert snap.configs["cleanup.policy"] == "compact"
    assert snap.copartition_with == "account.events"
    assert snap.partitions == topics["account.events"].partitions


def test_validate_command_exit_codes(tmp_path: Path) -> None:
    """`kafold config validate` exits 0 on a good file and 2 with the problems on a bad one."""
    ok = subprocess.run([sys.executable, "-m", "kafold.tools.cli", "config", "validate", "-c", str(EXAMPLE)],
                        capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[kafka]\nbootstrap_server = "x"\nsasl_password = "hunter2-literal"\n')
    res = subprocess.run([sys.executable, "-m", "kafold.tools.cli", "config", "validate", "-c", str(bad)],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 2
    assert "kafka.bootstrap_server" in res.stderr and "kafka.sasl_password" in res.stderr
    assert "Traceback" not in res.stderr
    assert "hunter2-literal" not in res.stderr + res.stdout  # the refused secret is not echoed


def test_configuration_reference_is_in_sync() -> None:
    """docs/configuration.md's reference equals what the schemas declare."""
    from kafold.tools.commands.reference import BEGIN, splice

    page = (ROOT / "docs" / "configuration.md").read_text()
    assert BEGIN in page, "docs/configuration.md lost its generated reference markers"
    assert splice(page) == page, (
        "docs/configuration.md is stale; regenerate it: .venv/bin/python -c \"from pathlib import Path; "
        "from kafold.tools.commands.reference import splice; p = Path('docs/configuration.md'); "
        "p.write_text(splice(p.read_text()))\"")


def test_effect_keys_are_documented_once() -> None:
    """The keys every effect connector shares appear once in the reference, each connector pointing to them."""
    from kafold.tools.commands.reference import render

    text = render()
    assert text.count("| `circuit_window` |") == 1
    assert text.count("Plus every key of [connectors.config (effect connectors)]") == 3


def test_a_task_without_postgres_never_guesses_a_database(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kafold import db

    monkeypatch.setenv("KAFOLD_DEV_DIR", str(tmp_path))  # no dev stack there either way
    with pytest.raises(ConfigError, match=r"postgres\.url: no \[postgres\] section reached the task"):
        db.from_environment({})
    assert db.from_environment({"KAFOLD_POSTGRES__URL": "postgresql://u@h/d"}).url == "postgresql://u@h/d"


def test_faust_modules_are_checked_when_the_file_loads(tmp_path: Path) -> None:
    """Each `daemon.faust_modules` entry must import and define `setup(app)`: found by `config validate`, naming
    the entry, not when the worker starts."""
    (tmp_path / "ext_broken.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "ext_nosetup.py").write_text("SETUP = 1\n")
    (tmp_path / "ext_notfunc.py").write_text("setup = 1\n")
    (tmp_path / "ext_good.py").write_text("def setup(app):\n    pass\n")
    found = problems_of("""
[daemon]
python_path = ["."]
faust_modules = ["ext_good", "ext_missing", "ext broken", "ext_broken", "ext_nosetup", "ext_notfunc"]
""", tmp_path)
    text = "\n".join(found)
    assert len(found) == 5 and "faust_modules[0]" not in text, found
    for i, words in [(1, "No module named 'ext_missing'"), (2, "expected a dotted module name"),
                     (3, "RuntimeError: boom at import"), (4, "has no 'setup'"), (5, "is not a function")]:
        assert any(f"daemon.faust_modules[{i}]" in p and words in p for p in found), (i, found)
