"""The OpenAPI document says what the API does: a model for every answer,
every error a problem document, and the bearer scheme."""

from __future__ import annotations

from typing import Any

from tests.api_server import serve_api
from tests.workflow_harness import harness

PROBLEM = "application/problem+json"
NEEDS_TEMPORAL = {
    ("post", "/v1/runs"),
    ("post", "/v1/approvals/{approval_id}/decision"),
    ("post", "/v1/approvals/{approval_id}/extend"),
    ("post", "/v1/actions/{action_id}/reconcile"),
    ("post", "/v1/runs/{run_id}/recover"),
}
PUBLIC = {"/healthz", "/readyz"}


def _schema_of(response: dict[str, Any], media: str) -> dict[str, Any]:
    return response["content"][media]["schema"]


def _is_model(schema: dict[str, Any]) -> bool:
    """A named model (or a list of one), not a free-form object."""
    if "$ref" in schema:
        return True
    return schema.get("type") == "array" and "$ref" in schema.get("items", {})


async def test_openapi_declares_models_problem_errors_and_bearer_for_every_route(
    tmp_path,
) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        document = (await api.http.get("/openapi.json")).json()
    schemes = document["components"]["securitySchemes"]
    assert {"type": "http", "scheme": "bearer"}.items() <= next(iter(schemes.values())).items()
    problem = document["components"]["schemas"]["ProblemDocument"]
    assert {"type", "title", "status", "code", "detail"} <= set(problem["required"])
    operations = [
        (method, path, op) for path, ops in document["paths"].items() for method, op in ops.items()
    ]
    assert len(operations) >= 15
    for method, path, op in operations:
        where = f"{method.upper()} {path}"
        responses = op["responses"]
        ok = [s for s in responses if s.startswith("2")]
        assert ok, where
        assert _is_model(_schema_of(responses[ok[0]], "application/json")), where
        errors = {s: r for s, r in responses.items() if s[0] in "45"}
        for status, response in errors.items():
            if path == "/readyz":
                continue
            assert list(response["content"]) == [PROBLEM], (where, status)
            assert _schema_of(response, PROBLEM) == {
                "$ref": "#/components/schemas/ProblemDocument"
            }, (where, status)
        if path in PUBLIC:
            continue
        assert op["security"] == [{name: []} for name in schemes], where
        assert {"401", "422"} <= set(errors), where
        if "{" in path:
            assert "404" in errors, where
        if method == "post":
            assert "413" in errors and "requestBody" in op, where
        if (method, path) in NEEDS_TEMPORAL:
            assert {"409", "503"} <= set(errors), where
        operator_only = ("/decision", "/extend", "/reconcile", "/recover")
        if path.endswith(operator_only) or path == "/codec/decode":
            assert "403" in errors, where
