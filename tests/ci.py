"""One rule for test prerequisites the suite installs itself (PostgreSQL,
Chromium, docker-compose): missing under CI=true is a failure; elsewhere a
skip that says why and how to get it."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def unavailable(what: str, how: str) -> NoReturn:
    if in_ci():
        pytest.fail(f"{what} is required in CI and is missing")
    pytest.skip(f"{what} is missing on this machine ({how})")
