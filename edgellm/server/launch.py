"""`edgellm serve`: pick the model spec, run uvicorn, build the AsyncEngine and warm the prefix
cache
in the background (the port answers, /health 503, while the model loads)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgellm import env
from edgellm.registry import (
    DEFAULT_SOURCE,
    ModelSpec,
    RegistryError,
    default_spec,
    load_registry,
    spec_for_path,
)
from edgellm.sampling import SamplingParams
from edgellm.tools.families import check_parser_name, choose_parser, detect_parser

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 16 * 1024  # request line + headers


def select_spec(args: argparse.Namespace) -> ModelSpec:
    """--model (a served name in the registry, or a path), else the registry's entry for the
    embedded
    default, else the embedded default under its usual name."""
    config = getattr(args, "config", None)
    registry: dict[str, ModelSpec] = {}
    if config is not None:
        registry = load_registry(config)
    elif Path("models.yaml").is_file():
        registry = load_registry("models.yaml")
    if args.model is not None:
        spec = registry.get(args.model) or spec_for_path(args.model)
    else:
        spec = (
            next((s for s in registry.values() if s.source == DEFAULT_SOURCE), None)
            or default_spec()
        )
    spec.check_files()
    if spec.quantization != "auto":
        spec.check_quantization()
    return spec


def tool_parser_name(spec: ModelSpec, args: argparse.Namespace) -> str | None:
    """The configured tool-call format: --tool-call-parser, else the registry's tool_parser
    (checked:
    an unknown name is a ValueError listing the known ones); None: chosen from the chat template."""
    name = getattr(args, "tool_call_parser", None) or spec.tool_parser
    return None if name is None else check_parser_name(name)


def _template_text(template: str | None) -> str | None:
    if not template:
        return None
    if "{%" in template or "{{" in template:
        return template
    path = Path(template).expanduser()
    if not path.is_file():
        raise RegistryError(f"chat template file not found: {template}")
    return path.read_text()


def build_engine(spec: ModelSpec, args: argparse.Namespace) -> Any:
    from edgellm.commands.engine_args import engine_config
    from edgellm.engine.async_engine import AsyncEngine

    kv_dtype = args.kv_cache_dtype if args.kv_cache_dtype != "auto" else spec.kv_cache_dtype
    config = engine_config(
        args,
        model=spec.model_arg,
        max_model_len=args.max_model_len or spec.max_model_len,
        kv_cache_dtype=kv_dtype,
        chat_template=None,
        architecture=getattr(args, "architecture", None) or spec.architecture,
    )
    if getattr(args, "engine_core", "thread") == "process":
        from edgellm.engine.core_client import EngineProcess

        engine: Any = EngineProcess(config)
    else:
        engine = AsyncEngine(config)
    template = _template_text(args.chat_template or spec.chat_template)
    if template is not None:
        if engine.tokenizer is None:
            logger.warning("%s has no tokenizer; ignoring the chat template override", spec.name)
        else:
            engine.tokenizer.hf.chat_template = template
    return engine


def warm_prompt_ids(tokenizer: Any, system_prompt: str) -> list[int]:
    """The tokens every conversation that opens with this system prompt starts with.

    Rendered as [system, user] twice with different user turns, the common
    token prefix is exactly what the prefix cache can share, whatever the
    template writes around the system turn.
    """
    if tokenizer.hf.chat_template:
        try:
            a = tokenizer.encode_chat(
                [{"role": "system", "content": system_prompt}, {"role": "user", "content": "Hi"}]
            )
            b = tokenizer.encode_chat(
                [
                    {"role": "system", "content": system_prompt},
                    {"role": "user", "content": "What is 2 + 2?"},
                ]
            )
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            return a[:n]
        except Exception as exc:  # noqa: BLE001  (a template without a system role)
            logger.warning("warm prompt: chat template failed (%s); prefilling the raw text", exc)
    return tokenizer.encode(system_prompt)


async def warm_up(engine: Any, spec: ModelSpec) -> None:
    """Prefill each warm prompt once so that its full blocks sit in the prefix cache."""
    if not spec.warm_prompts:
        return
    if engine.tokenizer is None:
        logger.warning("%s has no tokenizer; warm_prompts skipped", spec.name)
        return
    for i, prompt in enumerate(spec.warm_prompts):
        ids = warm_prompt_ids(engine.tokenizer, prompt)
        if len(ids) >= engine.max_model_len:
            logger.warning("warm prompt %d is longer than max_model_len; skipped", i)
            continue
        params = SamplingParams(max_tokens=1, temperature=0.0)
        async for out in engine.generate(f"warm-{i}", ids, params, prepared=(None, ids)):
            final = out
        logger.info(
            "warm prompt %d: %d tokens prefilled (%d cacheable)",
            i,
            len(ids),
            len(ids) // engine.config.block_size * engine.config.block_size,
        )
        del final


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def uvicorn_config(app: Any, args: argparse.Namespace) -> Any:
    import uvicorn

    # h11 (not httptools, even where installed) so that the header limit holds: a request line plus
    # headers over MAX_HEADER_BYTES is refused with a 400 and the connection closed.
    return uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=args.access_log,
        timeout_keep_alive=30,
        lifespan="on",
        timeout_graceful_shutdown=10,
        http="h11",
        h11_max_incomplete_event_size=getattr(args, "max_header_bytes", MAX_HEADER_BYTES),
    )


def serving_app(
    args: argparse.Namespace,
    spec: ModelSpec,
    api_key: str | None,
    build: Callable[[ModelSpec, argparse.Namespace], Any] = build_engine,
    on_load_failure: Callable[[BaseException], None] | None = None,
    after_load: Callable[[], Any] | None = None,
) -> tuple[Any, Any]:
    """The app `edgellm serve` runs and its ServedModel, whose engine is not built yet.

    The app answers at once; its lifespan starts the load in the background: `build(spec, args)` on
    a thread of its own (the AsyncEngine then loads the model on the engine thread), then the
    warm-up, then `after_load()` (`edgellm serve`: freeze_startup_heap). /health answers 503
    until all are done, then 200 (server/readiness.py)."""
    from edgellm.server.app import ServerSettings, create_app
    from edgellm.server.readiness import Readiness, in_thread
    from edgellm.server.served_model import ServedModel

    configured = tool_parser_name(spec, args)  # an unknown name stops here, before the load
    names = list(args.served_model_name or [spec.name])
    logger.info("serving %s (source %s) as %s", spec.name, spec.source, ", ".join(names))
    served = ServedModel(
        names=names,
        engine=None,
        max_waiting_requests=args.max_waiting_requests,
        tool_parser=configured,
    )

    async def load() -> None:
        engine = await in_thread(lambda: build(spec, args))
        template = engine.tokenizer.hf.chat_template if engine.tokenizer is not None else None
        chosen_by = (
            "configured"
            if configured
            else "chat template"
            if detect_parser(template)
            else "default"
        )
        logger.info("tool calls parsed as %s (%s)", choose_parser(configured, template), chosen_by)
        served.engine = engine
        await warm_up(engine, spec)
        if after_load is not None:
            after_load()

    settings = ServerSettings(
        api_key=api_key,
        metrics_public=args.metrics_public,
        max_body_bytes=args.max_request_body,
        max_header_bytes=getattr(args, "max_header_bytes", MAX_HEADER_BYTES),
    )
    app = create_app([served], settings, readiness=Readiness(load, on_load_failure))
    return app, served


def _freeze_startup_heap() -> None:
    from edgellm.engine.upkeep import freeze_startup_heap

    logger.info(
        "start-up heap frozen (%d objects out of the collector's reach)", freeze_startup_heap()
    )


def serve(args: argparse.Namespace) -> int:
    """Bind, load in the background, serve until stopped. A load that fails stops the server and
    is raised here (the CLI prints it as a start-up error)."""
    import uvicorn

    api_key = args.api_key or env.api_key()
    if not _is_loopback(args.host) and not api_key:
        logger.warning(
            "binding %s without --api-key: anyone who can reach this port can use the model",
            args.host,
        )
    spec = select_spec(args)
    failures: list[BaseException] = []
    server: Any = None

    def stop(exc: BaseException) -> None:
        failures.append(exc)
        if server is not None:
            server.should_exit = True

    app, served = serving_app(
        args, spec, api_key, on_load_failure=stop, after_load=_freeze_startup_heap
    )
    server = uvicorn.Server(uvicorn_config(app, args))
    try:
        server.run()
    finally:
        if served.engine is not None:
            served.engine.shutdown()
    if failures:
        raise failures[0]
    return 0
