"""Attacks on the redaction of a write's result (review of e982f90).

Each test is labelled:

* FINDING (fixed): a secret argument value still leaked (or data was lost)
  after e982f90; the test failed before the fix in this branch.
* FINDING (not fixed): still leaks; kept as ``xfail(strict=True)`` so the
  day it is fixed the marker has to go.
* DEFENDED: an attack the change already withstands, kept as a regression
  guard.
"""

from __future__ import annotations

import base64
import html
import json
import unicodedata

import pytest

from roundtable.security import (
    REDACTED,
    RESULT_VALUE_WITHHELD,
    redact_result,
    redact_text,
)
from roundtable.tools.registry import ToolDefiniteFailure
from tests.api_server import serve_api
from tests.test_workflow_execution import (
    AUTO,
    CANARY,
    one_comment,
    where_results_are_seen,
    wrap_tool,
)
from tests.workflow_harness import harness, script, ticket_call

TOKEN = "tok-9f8e7d6c5b4a"


def _text(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, default=repr)


# --------------------------------------------------------------- FINDING (fixed)


def test_finding_a_number_echoed_as_a_float_is_redacted() -> None:
    """FINDING (fixed): a PIN sent as 482913 came back as 482913.0 (a JSON
    number parsed as float by the tool's client): ``str(482913.0)`` is not
    ``"482913"``, so it was kept. 1e3 sent, 1000 answered: the same."""
    assert redact_result({"pin": 482913.0}, {"pin": 482913}) == {"pin": REDACTED}
    assert redact_result({"amount": 1000}, {"amount": 1e3}) == {"amount": REDACTED}
    assert redact_result({"n": [482913.0]}, {"pin": "482913"}) == {"n": [REDACTED]}
    # Numbers that are not an argument stay.
    assert redact_result({"count": 7, "pin": 482914}, {"pin": 482913}) == {
        "count": 7,
        "pin": 482914,
    }


def test_finding_an_html_escaped_echo_is_redacted() -> None:
    """FINDING (fixed): a ticket system answering with the comment it posted,
    HTML-escaped, kept a password with ``<``, ``>`` or ``&`` every few
    characters: no spelling matched and no 12-character window survived."""
    password = "P@ss<w0rd>&Go!"
    shown = redact_result({"body": html.escape(password)}, {"password": password})
    assert shown == {"body": REDACTED}
    shown = redact_result({"body": html.escape(password, quote=False)}, {"password": password})
    assert shown == {"body": REDACTED}


def test_finding_a_reflowed_or_renormalised_echo_is_withheld() -> None:
    """FINDING (fixed): a body echoed with its whitespace collapsed (markdown,
    HTML rendering) or in NFD (macOS-normalised text) differs from the
    argument at every space or accent, so no 12-character window matched and
    the whole comment was kept."""
    body = "correct  horse  battery  staple\r\nnext  line  here"
    shown = redact_result({"body": " ".join(body.split())}, {"body": body})
    assert shown == {"body": RESULT_VALUE_WITHHELD}
    french = "Café crème brûlée à côté élève"
    shown = redact_result({"body": unicodedata.normalize("NFD", french)}, {"body": french})
    assert shown == {"body": RESULT_VALUE_WITHHELD}
    # Full-width letters (U+FF41...), NFKC: secret-passphrase.
    full_width = "".join(chr(ord(c) + 0xFEE0) for c in "secret-passphrase")
    shown = redact_result({"x": unicodedata.normalize("NFKC", full_width)}, {"p": full_width})
    assert shown == {"x": RESULT_VALUE_WITHHELD}


def test_finding_hex_and_offset_base64_echoes_are_redacted() -> None:
    """FINDING (fixed): a token echoed hex-encoded, or inside a Basic
    credential (``base64("user:" + password)``: the password starts at a
    byte offset that is not a multiple of three, so its base64 differs from
    ``base64(password)``), was kept whole."""
    assert redact_result({"h": TOKEN.encode().hex()}, {"t": TOKEN}) == {"h": REDACTED}
    assert redact_result({"h": TOKEN.encode().hex().upper()}, {"t": TOKEN}) == {"h": REDACTED}
    for user in ("u", "us", "usr", "alice"):
        basic = base64.b64encode(f"{user}:{TOKEN}".encode()).decode()
        shown = redact_result({"Authorization": f"Basic {basic}"}, {"password": TOKEN})
        leaked = shown["Authorization"]
        assert basic not in leaked, (user, leaked)
        assert REDACTED in leaked or leaked == RESULT_VALUE_WITHHELD, (user, leaked)
    # And in error messages, which share the redactor.
    basic = base64.b64encode(f"alice:{TOKEN}".encode()).decode()
    assert basic not in redact_text(f"401 for Basic {basic}", {"password": TOKEN})


def test_finding_keys_redacted_alike_are_all_kept() -> None:
    """FINDING (fixed, data loss): keys are redacted too, and two keys that
    redact to the same text collapsed into one: the tool's other value was
    silently lost (the key ``[redacted]`` itself, or two secret keys)."""
    shown = redact_result({TOKEN: 1, "[redacted]": 2}, {"t": TOKEN})
    assert sorted(shown.values()) == [1, 2]
    other = "other-secret-x"
    shown = redact_result({TOKEN: 1, other: 2, "x": 3}, {"t": TOKEN, "u": other})
    assert sorted(shown.values()) == [1, 2, 3]
    assert TOKEN not in _text(shown) and other not in _text(shown)
    # Three alike, and a real key that looks like a numbered one.
    shown = redact_result(
        {TOKEN: 1, other: 2, f"{TOKEN}!": 3, "[redacted] (2)": 4},
        {"t": TOKEN, "u": other},
    )
    assert sorted(shown.values()) == [1, 2, 3, 4]
    # Many alike: 20,000 keys quoting a body in part, all withheld alike, all
    # kept (the numbering is linear; how fast is a benchmark's business).
    body = "a long and secret comment body"
    shown = redact_result({f"{body[:20]} #{i}": i for i in range(20_000)}, {"body": body})
    assert len(shown) == 20_000 and sorted(shown.values()) == list(range(20_000))


def test_finding_a_short_secret_echoed_under_its_own_name_is_redacted() -> None:
    """FINDING (fixed): values under four characters are never redacted from
    text (they would blank ordinary words), so a three-digit CVV or PIN the
    public arguments view hides came back as ``{"cvv": "123"}``. A value
    under the argument's own name, equal to it, is now redacted at any
    length; elsewhere short values still stay (see the not-fixed test)."""
    shown = redact_result({"cvv": "123", "card": {"cvv": 123}, "n": "123"}, {"cvv": "123"})
    assert shown == {"cvv": REDACTED, "card": {"cvv": REDACTED}, "n": "123"}
    # A safe field is shown as it was.
    assert redact_result({"cvv": "123"}, {"cvv": "123"}, ["cvv"]) == {"cvv": "123"}


async def test_finding_a_definite_failures_code_is_redacted(tmp_path) -> None:
    """FINDING (fixed): a tool's ToolDefiniteFailure ``code`` was stored as
    the action's ``error_code`` unredacted (only the message was): it is in
    the row, the API's actions view and the audit event payload."""

    def refuses_quoting_the_body(handler):  # type: ignore[no-untyped-def]
        async def handle(args, ctx):  # type: ignore[no-untyped-def]
            raise ToolDefiniteFailure(f"duplicate:{args.body}", f"already posted {args.body}")

        return handle

    async with one_comment(tmp_path, refuses_quoting_the_body) as (h, api, handle):
        (action,) = await h.store.list_actions(handle.id)
        assert action["status"] == "failed"
        for seen in await where_results_are_seen(h, api, handle):
            assert CANARY.lower() not in seen.lower()


# ------------------------------------------------------------------- DEFENDED


def test_defended_shapes_and_escapes() -> None:
    """DEFENDED: results that are not dicts, nested argument values, case,
    JSON nested in a JSON string, numbers inside text, and safe fields."""
    args = {"t": TOKEN, "tags": [{"a": "vip-customer"}], "pin": 482913}
    assert redact_result([TOKEN, {"k": TOKEN.upper()}], args) == [REDACTED, {"k": REDACTED}]
    assert redact_result(TOKEN, args) == REDACTED
    assert redact_result(None, args) is None
    assert redact_result({"x": "hello VIP-Customer"}, args) == {"x": f"hello {REDACTED}"}
    assert redact_result({"x": "pin=482913"}, args) == {"x": f"pin={REDACTED}"}
    nested = json.dumps({"raw": json.dumps({"t": 'to"k\\en-secret-1'})})
    shown = redact_result({"raw": nested}, {"t": 'to"k\\en-secret-1'})
    assert "secret-1" not in _text(shown)
    url = "https://x.example/cb?token=" + TOKEN.replace("-", "%2d")
    assert TOKEN[4:] not in _text(redact_result({"u": url}, args))
    assert redact_result({"t": TOKEN}, {"t": TOKEN}, ["t"]) == {"t": TOKEN}
    assert redact_result({7: TOKEN, True: "x"}, args) == {"7": REDACTED, "True": "x"}


async def test_defended_a_large_echoing_result_is_redacted_before_it_is_bounded(tmp_path) -> None:
    """DEFENDED: a result too large to inline is redacted before it is
    stored, so the preview the seat reads and the encrypted copy kept by
    reference (bounded_result, save_tool_result) are both free of it."""
    canary = "CANARY-sk-live-7f3a"

    def answers_big(handler):  # type: ignore[no-untyped-def]
        async def handle(args, ctx):  # type: ignore[no-untyped-def]
            done = await handler(args, ctx)
            return {
                **done,
                "echo": [args.body] * 50 + [html.escape(args.body)] * 50,
                "padding": "x" * 20_000,
            }

        return handle

    comment = ticket_call("ticket_comment", "T-7", body=f"note <{canary}> & please")
    async with (
        harness(
            tmp_path, customize=lambda reg, _t: wrap_tool(reg, "ticket_comment", answers_big)
        ) as h,
        serve_api(h) as api,
    ):
        handle = await h.start(
            task_text="t", script=script(("seat-1", 1, [comment])), write_policy=AUTO
        )
        assert (await handle.result()).status == "completed"
        (action,) = await h.store.list_actions(handle.id)
        assert action["status"] == "succeeded"
        thread = (await h.state(handle)).threads["seat-1"]
        answers = [m.content for m in thread if m.role == "tool"]
        assert answers and "result_ref" in answers[0]
        ref = json.loads(answers[0])["result"]["result_ref"]
        kept = _text(await h.store.get_tool_result(ref))
        assert "[redacted]" in kept
        shown = await api.http.get(f"/v1/runs/{handle.id}/actions", headers=api.auth("ops"))
        events = _text([e["payload"] for e in await h.store.list_events(handle.id)])
        for seen in (_text(action["result"]), shown.text, events, *answers, kept):
            assert canary.lower() not in seen.lower()


# --------------------------------------------------------- FINDING (not fixed)


@pytest.mark.xfail(strict=True, reason="FINDING (not fixed): pieces under 12 characters")
def test_not_fixed_a_secret_split_across_items_is_kept() -> None:
    """A tool that echoes a body as lines, or a token in chunks, each under
    the 12-character quote window, gives every piece of it back."""
    token = "sk-live-7f3a9b2c1d0e9f"
    shown = redact_result({"lines": ["sk-live-7f3", "a9b2c1d0e9f"]}, {"t": token})
    assert "a9b2c1d0e9f" not in _text(shown)


@pytest.mark.xfail(strict=True, reason="FINDING (not fixed): short values, reformatted")
def test_not_fixed_a_short_secret_reformatted_or_elsewhere_is_kept() -> None:
    """Under 12 characters only exact spellings are redacted; under 4, only
    under the argument's own name. A short password upper-cased with ß, or
    a 3-digit code under another key, is kept."""
    assert "STRASSE" not in _text(redact_result({"s": "STRASSE"}, {"p": "straße"}))
    assert "123" not in _text(redact_result({"code": "123"}, {"cvv": "123"}))


def _echoing_earlier_comments(handler):  # type: ignore[no-untyped-def]
    """A ticket system that answers a write with the whole ticket, earlier
    comments included (as many do)."""
    seen: list[str] = []

    async def handle(args, ctx):  # type: ignore[no-untyped-def]
        done = await handler(args, ctx)
        seen.append(args.body)
        return {**done, "comments": list(seen)}

    return handle


@pytest.mark.xfail(strict=True, reason="FINDING (not fixed): redaction is per action")
async def test_not_fixed_a_result_quoting_another_actions_secret_keeps_it(tmp_path) -> None:
    """A write's result is redacted of its own arguments only. A tool that
    answers with the ticket's comments hands back the secret body of an
    earlier write (another seat's, say) in plain text: stored in this
    action's row and served by the API."""
    canary = "CANARY-sk-live-7f3a"
    first = ticket_call("ticket_comment", "T-7", body=f"note {canary} please")
    second = ticket_call("ticket_comment", "T-7", body="a harmless second comment")
    async with (
        harness(
            tmp_path,
            customize=lambda reg, _t: wrap_tool(reg, "ticket_comment", _echoing_earlier_comments),
        ) as h,
        serve_api(h) as api,
    ):
        turns = script(("seat-1", 1, [first]), ("seat-2", 1, [second]))
        handle = await h.start(task_text="t", script=turns, write_policy=AUTO)
        assert (await handle.result()).status == "completed"
        actions = await h.store.list_actions(handle.id)
        assert [a["status"] for a in actions] == ["succeeded", "succeeded"]
        shown = await api.http.get(f"/v1/runs/{handle.id}/actions", headers=api.auth("ops"))
        assert shown.status_code == 200, shown.text
        assert canary not in shown.text


@pytest.mark.xfail(strict=True, reason="FINDING (not fixed): rows written before e982f90")
async def test_not_fixed_a_result_stored_before_the_change_is_served_as_stored(
    tmp_path, monkeypatch
) -> None:
    """Redaction happens once, before the row is written; the API serves
    ``result`` as stored (``action_to_public_dict`` re-redacts the arguments,
    not the result). Rows written before e982f90 (simulated by the old
    identity in ``_judged``) keep serving the echoed secret: no migration
    or read-time redaction covers them."""
    import activities.write_activities as writes

    monkeypatch.setattr(writes, "redact_result", lambda result, *_a, **_k: result)

    def echoes(handler):  # type: ignore[no-untyped-def]
        async def handle(args, ctx):  # type: ignore[no-untyped-def]
            return {**(await handler(args, ctx)), "echo": args.body}

        return handle

    async with one_comment(tmp_path, echoes) as (_h, api, handle):
        shown = await api.http.get(f"/v1/runs/{handle.id}/actions", headers=api.auth("ops"))
        assert shown.status_code == 200, shown.text
        assert CANARY not in shown.text
