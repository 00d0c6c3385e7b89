"""Processes we start must not outlive us: the kernel's parent-death signal
(util-linux's setpriv sets it before exec) kills a child however its parent
dies, SIGKILL and the OOM killer included, where no cleanup code runs."""

from __future__ import annotations

import shutil


def dies_with_us(command: list[str]) -> list[str]:
    """``command``, run so that it is killed when this process dies (as is,
    where setpriv is missing)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return command
    return [setpriv, "--pdeathsig", "KILL", "--", *command]
