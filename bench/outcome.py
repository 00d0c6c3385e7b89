"""How a benchmark command ends: its figures shown and, when asked, written
as JSON; then the process leaves without interpreter finalization
(roundtable.process_exit), with status 1 on any error."""

from __future__ import annotations

import asyncio
import json
import traceback
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, NoReturn

from roundtable.process_exit import leave

Figures = dict[str, Any]


def finish(
    measuring: Coroutine[Any, Any, Figures], show: Callable[[Figures], None], json_path: Path | None
) -> NoReturn:
    try:
        figures = asyncio.run(measuring)
        show(figures)
        if json_path:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(figures, indent=2, default=str) + "\n")
    except BaseException:
        traceback.print_exc()
        leave(1)
    leave(0)
