"""Exceptions the engine raises; app/ maps them to HTTP status codes."""


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequestError(EngineError):
    """The request cannot be served as asked (the client must change it): maps to HTTP 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class ModelLoadError(EngineError):
    """The model directory or checkpoint is unusable."""


class EngineDeadError(EngineError):
    """The engine loop has stopped (a worker died or a step raised); no further requests are served."""
