"""The bearer-key dependency of every authenticated route (`Who`): the key's project, or 401."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from canvasq.serve.files import ApiError
from canvasq.serve.keys import Principal, authenticate


def _principal(request: Request) -> Principal:
    """The key's project, or 401 (no key, not a bearer key, unknown or revoked)."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if not header:
        raise ApiError(
            401,
            "You didn't provide an API key: send `Authorization: Bearer <key>` "
            "(create one with `canvasq keys create`).",
            code="missing_api_key",
        )
    p = authenticate(request.app.state.store, token.strip()) if scheme.lower() == "bearer" else None
    if p is None:
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
    return p


Who = Annotated[Principal, Depends(_principal)]
