"""Publishing KV-cache events over ZeroMQ as vLLM does: `--kv-events-config` and the publisher.

KVEventsConfig is vLLM's JSON flag (enable_kv_cache_events, publisher, endpoint, replay_endpoint,
topic, buffer_steps, hwm, max_queue_size); a malformed one is a ValueError naming the key.

ZmqEventPublisher: the engine thread calls `publish(ts, events)` once per step; it only puts the
batch on a bounded queue (a full queue drops the batch and counts it, it never waits), so a slow
or absent subscriber never slows a step. A publisher thread of its own encodes each batch
(engine/kv_events.encode_batch) and sends it on a PUB socket as three frames: topic, the batch's
sequence number (8 bytes, big-endian; 0, 1, 2, ...), the msgpack payload. PUB drops messages for
a subscriber past its high-water mark instead of blocking. The last buffer_steps batches are kept
for replay: a client sends [b"", start_seq (8 bytes, big-endian)] to the ROUTER on replay_endpoint
(a DEALER socket, as vLLM's protocol expects) and gets every kept batch from start_seq on as
[b"", seq, payload], then [b"", -1 (8 bytes, signed), b""].

Endpoints bind when they are wildcards (*), IPv6 ([...]), loopback addresses, ipc:// or inproc://
(vLLM binds the first two and connects otherwise; the default here binds 127.0.0.1 only), and
connect otherwise (the subscriber binds).
"""

from __future__ import annotations

import collections
import ipaddress
import json
import logging
import queue
import threading
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from edgellm.engine.kv_events import KVCacheEvent, encode_batch

if TYPE_CHECKING:
    import zmq  # imported when a zmq publisher is made (the kv-events extra)

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" or "null" (vLLM's default: no events)
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "enable_kv_cache_events":
                ok = isinstance(value, bool)
            elif f.name == "replay_endpoint":
                ok = value is None or isinstance(value, str)
            elif f.name in ("buffer_steps", "hwm", "max_queue_size"):
                ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
            else:
                ok = isinstance(value, str)
            if not ok:
                raise ValueError(
                    f"--kv-events-config: {f.name!r} has an invalid value {value!r} "
                    f"(expected {_expected(f.name)})"
                )
        if self.publisher not in ("zmq", "null"):
            raise ValueError(
                f'--kv-events-config: \'publisher\' must be "zmq" or "null", got {self.publisher!r}'
            )
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(
                    f"--kv-events-config: {name!r} must be a tcp://, ipc:// or inproc:// "
                    f"address, got {value!r}"
                )

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            # noqa: TRY004  (bad input, as the rest)
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"--kv-events-config: unknown key {unknown[0]!r}; known keys: "
                f"{', '.join(sorted(known))}"
            )
        return cls(**raw)


def _expected(name: str) -> str:
    if name == "enable_kv_cache_events":
        return "true or false"
    if name == "replay_endpoint":
        return "an address or null"
    if name in ("buffer_steps", "hwm", "max_queue_size"):
        return "a positive integer"
    return "a string"


def _binds(endpoint: str) -> bool:
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0]
    if host == "*" or host.startswith("["):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _attach(sock: Any, endpoint: str) -> None:
    import zmq

    try:
        if _binds(endpoint):
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except zmq.ZMQError as exc:  # address in use, bad address
        sock.close(linger=0)
        raise ValueError(f"--kv-events-config: cannot open {endpoint!r}: {exc}") from None


class ZmqEventPublisher:
    """PUB + ROUTER replay on a thread of its own; sockets are opened (and bind errors raised)
    in the constructor and used only by that thread afterwards."""

    def __init__(self, config: KVEventsConfig) -> None:
        try:
            import msgpack  # noqa: F401  (encode_batch needs it on the publisher thread)
            import zmq
        except ImportError as exc:
            raise ValueError(
                f'--kv-events-config publisher "zmq" needs {exc.name}: '
                f"pip install 'edgellm[kv-events]'"
            ) from None
        self.config = config
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        _attach(self._pub, config.endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            try:
                _attach(self._replay, config.replay_endpoint)
            except ValueError:
                self._pub.close(linger=0)
                raise
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[float, list[KVCacheEvent]] | None] = queue.Queue(
            config.max_queue_size
        )
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.buffer_steps
        )
        self.num_accepted = 0  # batches queued by publish (all published once num_published equals)
        self.num_published = 0
        self.num_dropped = 0  # batches dropped because the queue was full
        self._thread = threading.Thread(target=self._run, name="edgellm-kv-events", daemon=True)
        self._thread.start()

    def publish(self, ts: float, events: list[KVCacheEvent]) -> None:
        """Hand one step's events to the publisher thread; never blocks."""
        try:
            self._queue.put_nowait((ts, events))
            self.num_accepted += 1
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1:
                logger.warning(
                    "KV event queue full (%d batches): dropping events", self.config.max_queue_size
                )

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def _run(self) -> None:
        seq = 0
        try:
            while True:
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._serve_replay(self._replay)
                try:
                    item = self._queue.get(timeout=0.02)
                except queue.Empty:
                    continue
                if item is None:
                    break
                payload = encode_batch(item[0], item[1])
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                seq += 1
                self.num_published = seq
        except Exception:  # never take the engine down: events stop, serving goes on
            logger.exception("the KV event publisher stopped")
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            self._ctx.term()

    def _serve_replay(self, replay: zmq.Socket[bytes]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))


def make_publisher(config: KVEventsConfig | None) -> ZmqEventPublisher | None:
    """The publisher the config asks for; None when events are off (the block manager then
    records nothing)."""
    if config is None or not config.active:
        return None
    return ZmqEventPublisher(config)
