"""One rule for test prerequisites the suite installs itself (PostgreSQL,
Chromium, docker-compose, Spin and gcc; `make test` installs each when
missing, through scripts/ensure-system-deps.sh): missing under CI=true is a
failure, never a skip; elsewhere (a machine where they cannot be installed,
say without root) a skip that says what is missing and how to get it."""

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
