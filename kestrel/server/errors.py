"""Errors answered in OpenAI's format: {"error": {"message", "type", "param", "code"}} with the HTTP status."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class ApiError(Exception):
    """An error answered to the client in OpenAI's format."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)
