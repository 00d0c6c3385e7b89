"""Names that cross process boundaries are defined once (roundtable/names.py);
what cannot import them (a shell script) is checked against them here."""

from __future__ import annotations

import re
from pathlib import Path

from temporalio.workflow import _Definition

from roundtable import names
from roundtable.temporal import SEARCH_ATTRIBUTE_TYPES
from workflows import search_attributes
from workflows.reconcile import ReconcileWorkflow
from workflows.roundtable import RoundtableWorkflow

ROOT = Path(__file__).resolve().parent.parent


def test_the_deploy_script_creates_exactly_the_search_attributes_we_use() -> None:
    script = (ROOT / "deploy" / "temporal-init.sh").read_text()
    loop = re.search(r"for pair in (.*?); do", script, re.S)
    assert loop, "temporal-init.sh no longer loops over NAME=Type pairs"
    pairs = dict(p.split("=") for p in loop.group(1).replace("\\", " ").split())
    assert pairs == names.SEARCH_ATTRIBUTES


def test_every_search_attribute_has_a_key_and_a_registration_type() -> None:
    keys = {key.name: key.indexed_value_type for key in search_attributes.ALL}
    assert set(keys) == set(names.SEARCH_ATTRIBUTES) == set(SEARCH_ATTRIBUTE_TYPES)
    for name, indexed_type in keys.items():
        assert SEARCH_ATTRIBUTE_TYPES[name] == indexed_type, name


def test_the_workflows_answer_to_the_names_callers_use() -> None:
    run = _Definition.must_from_class(RoundtableWorkflow)
    assert run.name == names.RUN_WORKFLOW
    assert set(run.updates) == {names.DECIDE_UPDATE, names.EXTEND_UPDATE, names.RECONCILE_UPDATE}
    assert set(run.signals) == {
        names.DECISION_SIGNAL,
        names.RECONCILE_SIGNAL,
        names.REFRESH_SIGNAL,
    }
    assert set(run.queries) == {names.STATE_QUERY}
    assert _Definition.must_from_class(ReconcileWorkflow).name == names.RECONCILE_WORKFLOW
