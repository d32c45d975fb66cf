"""The OpenAPI 3 document, generated from the same route table the app serves, so it
lists every route by construction.

Example:
    >>> doc = openapi_document([])
    >>> (doc["openapi"], doc["paths"])
    ('3.0.3', {})
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from anabranch.admin.routes import Route

ERROR_SCHEMA = {
    "type": "object",
    "properties": {"reason": {"type": "string"}},
    "required": ["reason"],
}


def _operation(route: Route) -> dict[str, Any]:
    parameters: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in route.path_params
    ]
    parameters += [
        {"name": name, "in": "query", "required": False, "schema": {"type": "boolean"}}
        for name in route.query
    ]
    responses: dict[str, Any] = {}
    if route.response_schema is None:
        responses["204"] = {"description": "Done."}
    else:
        responses["200"] = {
            "description": "OK.",
            "content": {route.content_type: {"schema": route.response_schema}},
        }
    for status in route.errors:
        responses[str(status)] = {
            "description": HTTPStatus(status).phrase,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
    responses.setdefault(
        "500",
        {
            "description": "Internal error (logged).",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        },
    )
    operation: dict[str, Any] = {
        "operationId": f"{route.method.lower()}_{route.handler.__name__}",
        "summary": route.summary,
        "tags": [route.tag],
        "parameters": parameters,
        "responses": responses,
    }
    if route.request_schema is not None:
        operation["requestBody"] = {
            "required": False,
            "content": {"application/json": {"schema": route.request_schema}},
        }
    return operation


def openapi_document(routes: list[Route], server_url: str = "") -> dict[str, Any]:
    """The OpenAPI 3.0 document describing ``routes``."""
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route)
    doc: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {
            "title": "anabranch admin API",
            "version": "2",
            "description": "Pulsar admin v2 compatible subset (DESIGN.md §3.3).",
        },
        "paths": paths,
        "components": {"schemas": {"Error": ERROR_SCHEMA}},
    }
    if server_url:
        doc["servers"] = [{"url": server_url}]
    return doc
