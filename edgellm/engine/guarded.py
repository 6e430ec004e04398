"""An engine step and a request add that fail only their own requests, never the loop that runs
them: what AsyncEngine's engine thread and the engine-core process (engine/core_process.py) both
do around LLMEngine.

`step_or_fail` runs one step; if it raises, the requests that step held finish with an error
(the client sees the exception's type only; the message and trace go to the log) and the engine
serves the others. `add_or_fail` adds one request and returns the exception a bad one raised,
for its caller alone.
"""

from __future__ import annotations

import logging
from typing import Any

from edgellm.engine.engine import LLMEngine
from edgellm.engine.output import RequestOutput
from edgellm.sampling import SamplingParams

logger = logging.getLogger(__name__)


def step_or_fail(engine: LLMEngine) -> list[RequestOutput]:
    """One step's outputs; a step that raises gives its requests' error outputs instead."""
    try:
        return engine.step()
    except Exception as exc:  # fail this step's requests, keep serving the others
        failed = engine.step_request_ids
        logger.exception(
            "engine step failed (requests %s)", failed if failed is not None else "all"
        )
        return engine.fail_step(f"internal error in the engine step ({type(exc).__name__})")


def add_or_fail(
    engine: LLMEngine,
    request_id: str,
    prompt_ids: list[int],
    prompt_text: str | None,
    params: SamplingParams,
    grammar: Any,
    priority: int,
) -> Exception | None:
    """Add the request; None when it is in, else what adding it raised (the request is not in)."""
    try:
        engine.add_request(request_id, prompt_ids, params, grammar=grammar, priority=priority)
    except Exception as exc:  # noqa: BLE001  (handed to the request's caller)
        return exc
    engine.prompts[request_id] = prompt_text
    return None


def abort_or_fail(engine: LLMEngine, request_id: str) -> None:
    """Abort the request; if aborting raises, free it as a failed request instead."""
    try:
        engine.abort_request(request_id)
    except Exception:  # never take the others down
        logger.exception("aborting %s failed", request_id)
        engine.fail_requests([request_id], "internal error in the engine (aborting the request)")
