"""The command line as a person meets it before anything runs: help that
reads plainly, usage errors that keep the --json promise, shell completion."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from roundtable.cli import app
from tests.dev_stack import run_cli


def _commands() -> list[list[str]]:
    """Every command path, groups included: ["start"], ["tokens", "create"], …"""
    paths: list[list[str]] = [[]]

    def walk(group: typer.core.TyperGroup, prefix: list[str]) -> None:
        for name, command in group.commands.items():
            paths.append([*prefix, name])
            if isinstance(command, typer.core.TyperGroup):
                walk(command, [*prefix, name])

    walk(typer.main.get_command(app), [])
    return paths


@pytest.mark.parametrize("path", _commands(), ids=lambda p: " ".join(p) or "roundtable")
def test_help_reads_flags_as_flags_and_leaks_no_markup(path: list[str]) -> None:
    """Flags once read `--json <bool>`, and docstrings' ``markup`` showed as is."""
    shown = CliRunner().invoke(app, [*path, "--help"], terminal_width=100)
    assert shown.exit_code == 0, shown.output
    text = shown.output
    assert "<bool>" not in text
    for leak in ("``", "[bold", "[/", "╭", "│"):
        assert leak not in text, (leak, text)
    if path and "--json" in text:
        (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("--json")]
        assert line.split()[1:3] == ["Print", "one"], line  # no type after a flag


def test_no_token_value_in_help(monkeypatch: pytest.MonkeyPatch) -> None:
    """Environment values never appear in help, the token least of all."""
    monkeypatch.setenv("ROUNDTABLE_API_TOKEN", "rt_secret-value-in-env")
    for path in _commands():
        shown = CliRunner().invoke(app, [*path, "--help"])
        assert "rt_secret-value-in-env" not in shown.output


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ROUNDTABLE_API")}


@pytest.mark.parametrize(
    "argv",
    [
        ["start"],  # a required option missing
        ["approve"],  # a required argument missing
        ["show", "run-1", "--no-such-option"],
        ["no-such-command"],
        ["start", "--task", "t", "--rounds", "many"],  # not a number
        [],  # no command at all
    ],
    ids=["no-option", "no-argument", "unknown-option", "unknown-command", "bad-int", "none"],
)
def test_usage_errors_are_one_json_document_with_json(tmp_path: Path, argv: list[str]) -> None:
    done = run_cli(*argv, "--json", cwd=tmp_path, env=_env())
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    error = json.loads(lines[0])["error"]
    assert error["code"] == "usage" and error["message"], error
    assert "Traceback" not in done.stderr


def test_usage_errors_without_json_go_to_stderr(tmp_path: Path) -> None:
    done = run_cli("start", cwd=tmp_path, env=_env())
    assert done.returncode == 2
    assert done.stdout == ""
    assert "Missing option '--task'" in done.stderr and "roundtable start --help" in done.stderr


def test_shell_completion_is_installable_and_completes(tmp_path: Path) -> None:
    env = {**_env(), "HOME": str(tmp_path), "SHELL": "/bin/bash"}
    shown = run_cli("--show-completion", "bash", cwd=tmp_path, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "_ROUNDTABLE_COMPLETE" in shown.stdout
    installed = run_cli("--install-completion", "bash", cwd=tmp_path, env=env)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert "roundtable" in (tmp_path / ".bashrc").read_text()
    completing = {
        **env,
        "_ROUNDTABLE_COMPLETE": "complete_bash",
        "COMP_WORDS": "roundtable appr",
        "COMP_CWORD": "1",
    }
    offered = run_cli(cwd=tmp_path, env=completing)
    assert offered.returncode == 0, offered.stderr
    assert {"approvals", "approve"} <= set(offered.stdout.split()), offered.stdout


def test_manager_none_means_no_manager() -> None:
    """`--manager none` once started a run with the default manager: None
    was dropped as an option not given."""
    from roundtable.cli.runs import build_request

    assert build_request(task_text="t", manager="none").manager is None
    assert build_request(task_text="t", manager="boss").manager == "boss"
    # An owner not given stays unset, so the API makes the token's owner the owner.
    assert "user_id" not in build_request(task_text="t").model_fields_set
