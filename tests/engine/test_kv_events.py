"""KV-cache events in vLLM's wire format over real ZeroMQ sockets: a SUB socket (pyzmq + msgpack,
as llm-d's indexer reads them) receives BlockStored events whose hashes and token ids are the
prefix cache's after a request, BlockRemoved after eviction, sequence numbers in order; missed
batches come back through the replay socket; the payload decodes with vLLM's own struct layout
(msgspec array_like + tag); a malformed --kv-events-config is a start-up error naming the key."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import msgspec
import pytest
import torch
import zmq

from edgellm.config import EngineConfig
from edgellm.engine.block_manager import BlockManager
from edgellm.engine.engine import LLMEngine
from edgellm.engine.kv_events import external_hash
from edgellm.engine.kv_publisher import KVEventsConfig, ZmqEventPublisher
from edgellm.engine.runner import kv_cache_bytes_per_block
from edgellm.engine.sequence import Sequence
from edgellm.sampling import SamplingParams
from tests.helpers.serverutil import free_port
from tests.helpers.tiny_models import build_tiny

TOPIC = "kv@tiny"


# vLLM's structs (vllm/distributed/kv_events.py, the array_like layout), to decode with
class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(_KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(_KVCacheEvent):
    pass


class _KVEventBatch(_EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path, _ = build_tiny("llama", tmp_path_factory.mktemp("tiny-llama"))
    return path


def events_config(**kw) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                          endpoint=f"tcp://127.0.0.1:{free_port()}", topic=TOPIC, **kw)


def small_engine(path, cfg: KVEventsConfig, blocks: int) -> LLMEngine:
    probe = LLMEngine(EngineConfig(model=str(path), kv_cache_memory=1 << 20))
    per_block = kv_cache_bytes_per_block(probe.model, 16, probe.kv_dtype)
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory=blocks * per_block, max_model_len=96,
                                    kv_events=cfg))
    assert engine.block_manager.num_blocks == blocks
    return engine


def run(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return prompt + list(out.outputs[0].token_ids)
    raise AssertionError("request never finished")


def receive(sub, quiet_s: float = 1.0) -> list[tuple[int, bytes]]:
    got = []
    while sub.poll(int(quiet_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC.encode() and len(seq) == 8
        got.append((int.from_bytes(seq, "big"), payload))
    return got


def replay(ctx, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return got
            got.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


def decoded(messages: list[tuple[int, bytes]]) -> list[list[Any]]:
    """Every event, in order, as the raw msgpack arrays; each payload also decodes as vLLM's."""
    events = []
    for _, payload in messages:
        ts, batch_events, dp_rank = msgpack.unpackb(payload)
        assert abs(ts - time.time()) < 600 and dp_rank == 0
        vllm = msgspec.msgpack.decode(payload, type=_KVEventBatch)
        assert len(vllm.events) == len(batch_events)
        events += batch_events
    return events


def cached_hashes(bm: BlockManager) -> set[int]:
    return {external_hash(h) for h in bm.cached}


def test_stored_then_removed_in_order_with_replay(tiny_llama):
    cfg = events_config(replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    engine = small_engine(tiny_llama, cfg, blocks=6)
    try:
        sub.connect(cfg.endpoint)
        time.sleep(1.0)  # the subscription reaches the publisher (PUB drops until it has)
        tokens_a = run(engine, "a", list(range(3, 43)), 10)  # 49 tokens computed: 3 full blocks
        first = receive(sub)
        stored = [e for e in decoded(first) if e[0] == "BlockStored"]
        assert stored and all(len(e) == 8 for e in stored)
        hashes_a = [h for e in stored for h in e[1]]
        assert len(hashes_a) == 3 and set(hashes_a) == cached_hashes(engine.block_manager)
        assert [t for e in stored for t in e[3]] == tokens_a[:48]
        parent = None
        for tag, hashes, parent_hash, token_ids, block_size, lora_id, medium, lora_name in stored:
            assert parent_hash == parent and block_size == 16 and len(token_ids) == 16 * len(hashes)
            assert lora_id is None and medium == "GPU" and lora_name is None
            parent = hashes[-1]

        run(engine, "b", list(range(100, 181)), 1)  # 81 tokens need all 6 blocks: A's are evicted
        second = receive(sub)
        events = decoded(second)
        removed = [h for e in events if e[0] == "BlockRemoved" for h in e[1]]
        assert sorted(removed) == sorted(hashes_a)
        assert not set(removed) & cached_hashes(engine.block_manager)
        stored_b = [h for e in events if e[0] == "BlockStored" for h in e[1]]
        assert len(stored_b) == 5 and set(stored_b) == cached_hashes(engine.block_manager)

        seqs = [s for s, _ in first + second]
        assert seqs == list(range(len(seqs)))  # in order, none missing
        assert engine.kv_publisher.num_dropped == 0
        # a subscriber that missed everything from batch 1 on asks for it again
        assert replay(ctx, cfg.replay_endpoint, 1) == (first + second)[1:]
        assert replay(ctx, cfg.replay_endpoint, len(seqs)) == []
    finally:
        engine.close()
        sub.close(linger=0)
        ctx.term()


def test_absent_subscriber_never_blocks_and_replay_has_everything(tiny_llama):
    cfg = events_config(replay_endpoint=f"tcp://127.0.0.1:{free_port()}", hwm=1)
    engine = small_engine(tiny_llama, cfg, blocks=8)
    ctx = zmq.Context()
    try:
        for i in range(4):  # nobody subscribes: the steps run as ever
            run(engine, f"r{i}", list(range(3 + 40 * i, 43 + 40 * i)), 4)
        publisher = engine.kv_publisher
        deadline = time.monotonic() + 10
        while publisher.num_published < publisher.num_accepted and time.monotonic() < deadline:
            time.sleep(0.05)  # every batch published, so the replay holds them all
        assert publisher.num_accepted > 0 and publisher.num_dropped == 0
        got = replay(ctx, cfg.replay_endpoint, 0)
        assert [s for s, _ in got] == list(range(len(got))) and got
        stored = {h for e in decoded(got) if e[0] == "BlockStored" for h in e[1]}
        removed = {h for e in decoded(got) if e[0] == "BlockRemoved" for h in e[1]}
        assert stored - removed == cached_hashes(engine.block_manager)
    finally:
        engine.close()
        ctx.term()


def test_block_manager_records_nothing_unless_asked_and_clears():
    seq = Sequence("s", list(range(1, 40)), SamplingParams(), [], 0)
    plain = BlockManager(8, 16)
    plain.ensure_slots(seq, 39)
    plain.cache_full_blocks(seq, 39)
    assert plain.events is None and plain.take_events() == []

    bm = BlockManager(8, 16, record_events=True)
    seq = Sequence("t", list(range(1, 40)), SamplingParams(), [], 0)
    bm.ensure_slots(seq, 39)
    bm.cache_full_blocks(seq, 20)
    bm.cache_full_blocks(seq, 39)  # the second block joins: chained to the first
    first, second = bm.take_events()
    assert first.parent_block_hash is None and second.parent_block_hash == first.block_hashes[0]
    assert second.token_ids == list(range(17, 33))
    bm.free(seq)
    bm.reset_prefix_cache()
    assert [type(e).__name__ for e in bm.take_events()] == ["AllBlocksCleared"]
    assert bm.take_events() == []


@pytest.mark.parametrize("text, named", [
    ('{"enable_kv_cache_events": true, "endpointt": "tcp://127.0.0.1:1"}', "'endpointt'"),
    ('{"enable_kv_cache_events": "yes"}', "'enable_kv_cache_events'"),
    ('{"publisher": "kafka"}', "'publisher'"),
    ('{"buffer_steps": 0}', "'buffer_steps'"),
    ('{"endpoint": "http://x:1"}', "'endpoint'"),
    ('{"topic": 5}', "'topic'"),
    ("[1]", "JSON object"),
    ("{nope", "not valid JSON"),
])
def test_malformed_config_names_the_key(text, named, capsys):
    with pytest.raises(ValueError, match=named.replace("'", "'")):
        KVEventsConfig.from_json(text)
    from edgellm.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--kv-events-config", text, "--port", str(free_port())])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_endpoint_in_use_is_a_start_up_error():
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{port}")
        with pytest.raises(ValueError, match=f"127.0.0.1:{port}"):
            ZmqEventPublisher(cfg)
    finally:
        taken.close(linger=0)
        ctx.term()


def test_serve_flag_publishes_events_for_http_requests(tiny_llama):
    import httpx

    from edgellm.cli import build_parser
    from edgellm.server.launch import select_spec, serving_app
    from tests.helpers.serverutil import ThreadServer

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    # the engine in this process (thread), so the test can read its block manager
    args = build_parser().parse_args([
        "serve", "--model", str(tiny_llama), "--kv-cache-memory", "4M", "--max-model-len", "96",
        "--served-model-name", "tiny", "--engine-core", "thread", "--kv-events-config",
        f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "{endpoint}", "topic": "{TOPIC}"}}'])
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    app, served = serving_app(args, select_spec(args), None)
    try:
        with ThreadServer(app) as srv:
            deadline = time.monotonic() + 120
            while httpx.get(srv.url + "/health").status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            sub.connect(endpoint)
            time.sleep(1.0)
            prompt = list(range(7, 47))
            r = httpx.post(srv.url + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200
            events = decoded(receive(sub))
            stored = [e for e in events if e[0] == "BlockStored"]
            assert [t for e in stored for t in e[3]] == prompt[:32]  # 41 computed tokens: 2 full blocks
            assert {h for e in stored for h in e[1]} == cached_hashes(served.engine.engine.block_manager)
    finally:
        if served.engine is not None:
            served.engine.shutdown()
        sub.close(linger=0)
        ctx.term()
