"""What every route reaches: the served models by name, the limits, the load state, the metrics.

`create_app` builds one ServerState and keeps it on `app.state.server`; a route takes it as a
FastAPI dependency (`AppState`), so that no route closes over `create_app`'s locals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from edgellm.server.errors import APIError
from edgellm.server.guard import ServerSettings
from edgellm.server.metrics import ServerMetrics
from edgellm.server.readiness import Readiness
from edgellm.server.served_model import ServedModel


@dataclass
class ServerState:
    """The served models (the first is the default), each name they answer to, and what the
    routes share. Build it with `ServerState.build`."""

    models: list[ServedModel]
    by_name: dict[str, ServedModel]
    settings: ServerSettings
    readiness: Readiness
    metrics: ServerMetrics

    @classmethod
    def build(
        cls, models: list[ServedModel], settings: ServerSettings, readiness: Readiness
    ) -> ServerState:
        """The state over `models`: a name used twice is a ValueError. Every ServedModel gets the
        one ServerMetrics, whose engine collector reads the engines that are built already."""
        by_name: dict[str, ServedModel] = {}
        for served in models:
            for name in served.names:
                if name in by_name:
                    raise ValueError(f"served model name {name!r} is used twice")
                by_name[name] = served
        metrics = ServerMetrics(lambda: {m.name: m.engine for m in models if m.engine is not None})
        for served in models:
            served.metrics = metrics
        return cls(models, by_name, settings, readiness, metrics)

    def lookup(self, name: str | None) -> ServedModel:
        """The model a request names (None: the default one); an unknown name is a 404."""
        if name is None:
            return self.models[0]
        served = self.by_name.get(name)
        if served is None:
            raise APIError(
                404,
                f"The model '{name}' does not exist. Served models: {', '.join(self.by_name)}.",
                param="model",
                code="model_not_found",
            )
        return served


async def server_state(request: Request) -> ServerState:
    """The app's ServerState (async, so that FastAPI resolves it on the event loop)."""
    state: ServerState = request.app.state.server
    return state


AppState = Annotated[ServerState, Depends(server_state)]
