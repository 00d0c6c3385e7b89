"""The one skip the suite allows (tests/ci.py): a prerequisite missing on
this machine. Under CI=true it is a failure, so CI can never go green with
PostgreSQL (or Chromium, docker-compose, Spin, gcc) missing."""

from __future__ import annotations

import pytest

from tests.ci import unavailable


def test_a_missing_prerequisite_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    for value in ("true", "1", "YES"):
        monkeypatch.setenv("CI", value)
        with pytest.raises(pytest.fail.Exception, match="PostgreSQL is required in CI"):
            unavailable("PostgreSQL", "make test installs it")


def test_elsewhere_it_is_a_skip_that_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"missing on this machine \(make test"):
        unavailable("PostgreSQL", "make test installs it")
