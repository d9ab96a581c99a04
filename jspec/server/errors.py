"""OpenAI's error shape, apart from the request models so that code with no server
(the chat template in training scripts, for one) needs no pydantic."""

from __future__ import annotations


class APIError(Exception):
    """An error the client caused (or a missing resource): becomes OpenAI's error body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
