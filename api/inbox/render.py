"""The inbox's HTML, built from the API's public views only (redacted
arguments, allowlisted fields); every value is escaped."""

from __future__ import annotations

import json
from html import escape
from typing import Any

from api.inbox.session import Signed

ASSETS = "/inbox/static"
EXTEND_CHOICES = ((900, "15 minutes"), (3600, "1 hour"), (4 * 3600, "4 hours"))


def e(value: Any) -> str:
    return escape("" if value is None else str(value), quote=True)


def pretty(value: Any) -> str:
    return e(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False))


def page(title: str, body: str, signed: Signed | None) -> str:
    nav = ""
    meta = ""
    if signed is not None:
        who = signed.principal
        meta = f'<meta name="csrf-token" content="{e(signed.csrf)}">'
        nav = f"""
<nav aria-label="Inbox">
  <ul>
    <li><a href="/inbox">Pending approvals</a></li>
    <li><a href="/inbox/unknown">Unknown actions</a></li>
  </ul>
  <p class="who">Signed in as <strong>{e(who.user_id)}</strong> ({e(who.role)})</p>
  <form method="post" action="/inbox/logout" class="signout">
    <input type="hidden" name="csrf_token" value="{e(signed.csrf)}">
    <button type="submit">Sign out</button>
  </form>
</nav>"""
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
{meta}
<title>{e(title)} · Roundtable</title>
<link rel="stylesheet" href="{ASSETS}/inbox.css">
<script src="{ASSETS}/inbox.js" defer></script>
</head>
<body>
<a class="skip" href="#main">Skip to content</a>
<header><p class="brand">Roundtable</p>{nav}</header>
<main id="main">
<h1>{e(title)}</h1>
<p id="announce" class="announce" role="status" aria-live="polite"></p>
{body}
</main>
</body>
</html>"""


def login(error: str | None = None) -> str:
    problem = f'<p class="error" role="alert">Sign-in refused: {e(error)}</p>' if error else ""
    return page(
        "Sign in",
        f"""{problem}
<form method="post" action="/inbox/login" class="login">
  <label for="token">API token</label>
  <input id="token" name="token" type="password" autocomplete="off" required
         spellcheck="false" aria-describedby="token-help">
  <p id="token-help" class="help">The token <code>roundtable token create</code> printed
  (or the operator token <code>make run</code> printed). It is checked as the API
  checks it, then forgotten: the page keeps only a session cookie.</p>
  <button type="submit">Sign in</button>
</form>""",
        None,
    )


def approval_entry(view: dict[str, Any], task: str | None, risk: str, signed: Signed) -> str:
    """One pending approval; the hooks (data-approval-id, data-action) are stable."""
    aid = view["id"]
    decides = signed.principal.may_decide(view.get("run_owner", ""))
    choices = "".join(f'<option value="{s}">{e(label)}</option>' for s, label in EXTEND_CHOICES)
    controls = (
        f"""
  <div class="controls">
    <button type="button" data-action="approve">Approve</button>
    <button type="button" data-action="edit" aria-expanded="false">Edit arguments…</button>
    <span class="reject">
      <label for="reason-{e(aid)}">Reason for the seat</label>
      <input id="reason-{e(aid)}" data-field="reason" maxlength="2000">
      <button type="button" data-action="reject">Reject</button>
    </span>
    <span class="extend">
      <label for="extend-{e(aid)}">More time</label>
      <select id="extend-{e(aid)}" data-field="seconds">{choices}</select>
      <button type="button" data-action="extend">Extend</button>
    </span>
  </div>
  <div class="editor" hidden></div>"""
        if decides
        else '<p class="help">You may see this approval but not decide it.</p>'
    )
    return f"""<article class="approval" data-approval-id="{e(aid)}"
 data-digest="{e(view.get("arguments_digest"))}" data-expires-at="{e(view["expires_at"])}"
 aria-labelledby="title-{e(aid)}">
  <h2 id="title-{e(aid)}"><span class="tool">{e(view["tool_name"])}</span>
    <span class="risk" data-risk="{e(risk)}">risk {e(risk)}</span></h2>
  <dl>
    <dt>Seat</dt><dd class="seat">{e(view["agent_id"])}</dd>
    <dt>Run</dt><dd><a href="/inbox/runs/{e(view["run_id"])}">{e(view["run_id"])}</a></dd>
    <dt>Task</dt><dd class="task">{e(task)}</dd>
    <dt>Expires</dt><dd><time class="countdown" datetime="{e(view["expires_at"])}">{
        e(view["expires_at"])
    }</time></dd>
  </dl>
  <h3>Arguments <span class="help">(public view: secret values read “[redacted]”)</span></h3>
  <pre class="arguments">{pretty(view.get("arguments"))}</pre>
  {controls}
  <p class="outcome" role="status" aria-live="polite"></p>
</article>"""


def inbox(entries: list[str]) -> str:
    listing = "".join(entries)
    return f"""
<p class="help">Most urgent first. New approvals appear and decided or expired ones
leave by themselves; the countdowns are live.</p>
<p class="empty" {"hidden" if entries else ""}>Nothing waits for you.</p>
<section id="approvals" aria-label="Pending approvals" data-live="/inbox/events">
{listing}
</section>"""


def unknown(rows: list[dict[str, Any]], operator: bool) -> str:
    if not rows:
        return '<p class="empty">No action has an unknown outcome.</p>'
    out = [
        '<p class="help">Each of these writes may or may not have happened; its target is '
        "blocked until an operator finds out and says which. A reconciliation is refused "
        "while the attempt may still be running.</p>"
    ]
    for row in rows:
        action = row["action"]
        aid = action["id"]
        if operator:
            form = f"""
  <form class="reconcile" data-action-id="{e(aid)}">
    <fieldset>
      <legend>What happened in {e(action["tool_name"])}?</legend>
      <label><input type="radio" name="outcome" value="succeeded"> It succeeded</label>
      <label><input type="radio" name="outcome" value="failed"> It failed</label>
    </fieldset>
    <label for="note-{e(aid)}">Note (what you checked)</label>
    <input id="note-{e(aid)}" name="note" required maxlength="2000">
    <button type="submit" data-action="reconcile">Reconcile</button>
  </form>"""
        else:
            form = '<p class="help">Only operators reconcile.</p>'
        out.append(f"""<article class="unknown" data-action-id="{e(aid)}"
 aria-labelledby="u-{e(aid)}">
  <h2 id="u-{e(aid)}">{e(action["tool_name"])} <span class="status">unknown</span></h2>
  <dl>
    <dt>Run</dt><dd><a href="/inbox/runs/{e(action["run_id"])}">{e(action["run_id"])}</a></dd>
    <dt>Seat</dt><dd>{e(action["agent_id"])}</dd>
    <dt>Target</dt><dd class="target">{e(row["target"])}</dd>
    <dt>Attempt started</dt><dd>{e(action["started_at"] or "never")}</dd>
    <dt>Attempt stopped</dt><dd>{e(action["finished_at"] or "not known")}</dd>
    <dt>Attempts</dt><dd>{e(action["attempt_count"])}</dd>
    <dt>Last error</dt><dd class="last-error">{e(row["error"] or "none recorded")}</dd>
  </dl>
  <h3>Arguments (public view)</h3>
  <pre class="arguments">{pretty(action.get("arguments"))}</pre>
  {form}
  <p class="outcome" role="status" aria-live="polite"></p>
</article>""")
    return "".join(out)


def table(caption: str, headers: list[str], rows: list[list[str]], cls: str) -> str:
    if not rows:
        return f'<h2>{e(caption)}</h2><p class="empty">None.</p>'
    head = "".join(f'<th scope="col">{e(h)}</th>' for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return (
        f'<h2>{e(caption)}</h2><div class="scroll"><table class="{cls}">'
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
    )


def run_page(
    run: dict[str, Any],
    task: str | None,
    transcript: list[dict[str, Any]] | None,
    fencing: dict[str, Any],
    events: list[dict[str, Any]],
    chain_ok: bool,
) -> str:
    failure = run.get("failure")
    parts = [
        f"""<dl class="run">
  <dt>Status</dt><dd class="run-status">{e(run["status"])}</dd>
  <dt>Owner</dt><dd>{e(run["user_id"])}</dd>
  <dt>Task</dt><dd>{e(task)}</dd>
  <dt>Started</dt><dd>{e(run["created_at"])}</dd>
  {f"<dt>Why</dt><dd>{e(failure.get('code'))}: {e(failure.get('message'))}</dd>" if failure else ""}
</dl>"""
    ]
    if transcript is None:
        parts.append(
            '<h2>Transcript</h2><p class="help">The transcript is read from the run\'s '
            "workflow; it did not answer (no worker, or the run is long closed).</p>"
        )
    else:
        items = "".join(
            f'<li><p class="speaker">{e(m["speaker"])}</p><p>{e(m["text"])}</p>'
            + (f'<p class="calls">asked for: {e(", ".join(m["calls"]))}</p>' if m["calls"] else "")
            + "</li>"
            for m in transcript
        )
        items = items or "<li>None yet.</li>"
        parts.append(f'<h2>Transcript</h2><ol class="transcript">{items}</ol>')
    parts.append(
        table(
            "Actions",
            ["Tool", "Seat", "Status", "Risk", "Fencing token", "Attempts", "Arguments (public)"],
            [
                [
                    e(a["tool_name"]),
                    e(a["agent_id"]),
                    e(a["status"]),
                    e(a["risk_level"]),
                    f'<span class="fencing-token">{e(fencing.get(a["id"]) or "—")}</span>',
                    e(a["attempt_count"]),
                    f"<pre>{pretty(a['arguments'])}</pre>",
                ]
                for a in run["actions"]
            ],
            "actions",
        )
    )
    parts.append(
        table(
            "Approvals",
            ["Tool", "Seat", "Status", "Decided by", "Reason", "Expires"],
            [
                [
                    e(a["tool_name"]),
                    e(a["agent_id"]),
                    e(a["status"]),
                    e(a["decided_by"] or "—"),
                    e(a["decision_reason"] or "—"),
                    e(a["expires_at"]),
                ]
                for a in run["approvals"]
            ],
            "approvals",
        )
    )
    verdict = (
        '<p class="chain ok" data-chain="verified">✔ Hash chain verified: every event links '
        "to the one before and the last matches the run.</p>"
        if chain_ok
        else '<p class="chain broken" data-chain="broken" role="alert">✘ Hash chain BROKEN: '
        "the audit log was altered.</p>"
    )
    parts.append('<h2 id="audit">Audit trail</h2>' + verdict)
    parts.append(
        table(
            "Events",
            ["#", "Event", "At", "Details", "Hash"],
            [
                [
                    e(ev["seq"]),
                    e(ev["event_type"]),
                    e(ev["created_at"]),
                    f"<pre>{pretty(ev['payload'])}</pre>",
                    f'<code title="{e(ev["hash"])}">{e(ev["hash"][:16])}…</code>',
                ]
                for ev in events
            ],
            "events",
        )
    )
    return "".join(parts)
