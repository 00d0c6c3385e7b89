"""The approvals inbox (issue 15): the web page operators decide from.

Server-rendered HTML and one small script, every asset served from this
package. A browser signs in with an API token (checked exactly as the API
checks a bearer token, api/auth.py) and then holds a session cookie
(``HttpOnly; SameSite=Strict; Path=/inbox``); every POST carries the
session's CSRF token. Decisions, extensions and reconciliations call the
API's own route functions, so the rules (visibility, roles, separation of
duties, tenants, digests, races) are the API's, not a copy of them.
"""

from api.inbox.routes import router

__all__ = ["router"]
