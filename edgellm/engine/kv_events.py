"""KV-cache events (what the prefix cache gained and lost) and vLLM's msgpack wire form of them.

The block manager records an event whenever a full block enters the prefix cache (BlockStored),
leaves it (BlockRemoved: evicted for new data, or dropped because its KV is suspect) or the whole
cache is dropped (AllBlocksCleared). The engine hands each step's events to its publisher
(engine/kv_publisher.py), which encodes them off the engine thread with `encode_batch`.

Wire form: vLLM's `vllm/distributed/kv_events.py` structs in msgspec's array_like + tag layout,
as precise prefix-aware routers (llm-d's KV indexer, Dynamo's KV router) decode them:

    EventBatch        [ts, [event, ...], data_parallel_rank]
    BlockStored       ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                       lora_id, medium, lora_name]
    BlockRemoved      ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared  ["AllBlocksCleared"]

Every field is present (array_like structs are positional; None is nil). Decoders of vLLM
versions with fewer trailing fields ignore the extra ones, and versions with more trailing
fields (extra_keys, group_idx) take their defaults. Block hashes are sent in vLLM's integer
form: the last 8 bytes of the block's digest, big-endian, unsigned (see `external_hash`).
medium is "GPU", vLLM's name for the engine's own KV cache, whichever device holds it.
Recent vLLM releases encode the events (not the batch) as tagged maps instead; that form is not
produced here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MEDIUM = "GPU"


def external_hash(digest: bytes) -> int:
    """A block digest as vLLM's events carry it (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES form)."""
    return int.from_bytes(digest[-8:], "big")


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]  # consecutive blocks of one prefix chain, in order
    parent_block_hash: int | None  # the block before the first of them; None at a prompt's start
    token_ids: list[int]  # their tokens, block after block (len = len(block_hashes) * block_size)
    block_size: int
    lora_name: str | None = None
    medium: str = MEDIUM


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str = MEDIUM


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _wire(event: KVCacheEvent) -> list[object]:
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            None,
            event.medium,
            event.lora_name,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    return ["AllBlocksCleared"]


def encode_batch(ts: float, events: list[KVCacheEvent], data_parallel_rank: int = 0) -> bytes:
    """One EventBatch as msgpack bytes (the third frame of a published message)."""
    import msgpack

    return msgpack.packb(
        [float(ts), [_wire(e) for e in events], data_parallel_rank], use_bin_type=True
    )


def stored_events(
    hashes: Sequence[bytes], indices: list[int], token_ids: Sequence[int], block_size: int
) -> list[BlockStored]:
    """One BlockStored per run of consecutive newly cached blocks (`indices` into a sequence's
    chain of block `hashes`), chained to its parent."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    events = []
    for run in runs:
        first, last = run[0], run[-1]
        parent = external_hash(hashes[first - 1]) if first > 0 else None
        events.append(
            BlockStored(
                [external_hash(hashes[i]) for i in run],
                parent,
                list(token_ids[first * block_size : (last + 1) * block_size]),
                block_size,
            )
        )
    return events
