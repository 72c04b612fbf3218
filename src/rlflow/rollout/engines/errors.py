"""The error a rollout server raises: a leaf, so that the server engine, its fleet and the weight-transfer
protocol's server half can all name it without importing each other."""

from __future__ import annotations


class ServerError(RuntimeError):
    """A server answered with an error, or could not be reached after every retry; the message names the URL.
    ``status``: the HTTP status of an answer refusing the request (``None``: no answer)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status
