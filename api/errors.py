"""The one error a request can meet in the api layer, answered as OpenAI's error body with its status."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(
        self, message: str, status: int = 400, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.kind = message, status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
