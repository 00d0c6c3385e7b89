"""The codec token the Temporal UI must carry in its URL never reaches a log."""

from __future__ import annotations

import logging

from api import access_log


def test_uvicorn_access_lines_print_the_codec_path_without_its_token(caplog) -> None:
    access_log.install()
    access_log.install()  # once is enough, twice changes nothing
    logger = logging.getLogger("uvicorn.access")
    assert sum(isinstance(f, access_log.RedactTokenPaths) for f in logger.filters) == 1
    with caplog.at_level(logging.INFO, logger="uvicorn.access"):
        # The shape of uvicorn's own access record.
        logger.info(
            '%s - "%s %s HTTP/%s" %d',
            "127.0.0.1:5555",
            "POST",
            "/codec/t/rt_SEKRET-token/decode?x=1",
            "1.1",
            200,
        )
    (line,) = [r.getMessage() for r in caplog.records]
    assert "SEKRET" not in line
    assert "/codec/t/[redacted]/decode?x=1" in line
