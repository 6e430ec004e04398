"""Shared-prefix ("cascade") prefill attention on CPU: prefill chunks that start with the same
cached blocks attend that prefix once for all their queries. By the kernel chosen at load
(edgellm/attention/cpu_prefix.py): "scores", one C++ pass per query row over the prefix and the
chunk's own keys in the prefill dtype's products (bf16 or fp32); or "flash", the prefix in one
torch flash product, each chunk its own suffix (causally: the C++ kernel over the pages in fp32
where it applies, else torch's flash), merged by log-sum-exp. A voice agent's turns over one
cached system prompt are exactly that.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from edgellm.attention.cpu_prefix import flash
from edgellm.kernels.paged_attention import gather_kv

CASCADE_MIN_PREFIX = 64  # tokens of shared prefix worth one product of their own


def _shared_prefix_blocks(
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_start_loc: list[int],
    first: int,
    block_size: int,
) -> int:
    """Leading blocks that every prefill chunk from `first` on shares and that lie wholly before
    each chunk's first new token (so every query sees all of them: no mask)."""
    idx = range(first, len(seq_lens))
    past = min(
        (seq_lens[i] - (query_start_loc[i + 1] - query_start_loc[i])) // block_size for i in idx
    )
    if past * block_size < CASCADE_MIN_PREFIX:
        return 0
    rows = block_tables[first:, :past]
    same = (rows == rows[:1]).all(0)
    return past if bool(same.all()) else int(same.int().argmin())


def _suffixes_batched(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: list[int],
    dtype: torch.dtype,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each chunk to its own tokens (q [Nq, Hq, D], k/v [Nq, Hkv, D], chunks of
    `lens` rows back to back) in one flash call over [chunks, H, longest, D], padded at the end:
    (output [Nq, Hq, D], logsumexp [Nq, Hq] fp32)."""
    n, lmax = len(lens), max(lens)
    pos = None
    if any(n_ != lmax for n_ in lens):
        pos = torch.cat([torch.arange(j * lmax, j * lmax + n_) for j, n_ in enumerate(lens)])

    def pad(t: torch.Tensor) -> torch.Tensor:  # [Nq, H, D] -> [chunks, H, longest, D]
        t = t.to(dtype)
        if pos is not None:
            t = t.new_zeros(n * lmax, *t.shape[1:]).index_copy_(0, pos, t)
        return t.view(n, lmax, *t.shape[1:]).transpose(1, 2)

    o, lse = flash(pad(q), pad(k), pad(v), None, scale, causal=True)
    o = o.transpose(1, 2).reshape(n * lmax, q.shape[1], q.shape[2])  # [chunks * longest, Hq, D]
    lse = lse.transpose(1, 2).reshape(n * lmax, q.shape[1])
    if pos is not None:
        o, lse = o.index_select(0, pos), lse.index_select(0, pos)
    return o, lse


def cascade_prefill(
    query,
    key,
    value,
    kv_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    first,
    scale,
    k_scale,
    v_scale,
    dtype,
    step_cache,
    out,
    prefix_kernel="flash",
    native=None,
    native_prefill=None,
) -> int:
    """Prefill chunks [first, B) through shared-prefix attention when at least two share a cached
    prefix of CASCADE_MIN_PREFIX tokens or more: all their queries against the prefix in one flash
    call, each chunk against its own suffix (causal), merged by log-sum-exp. Returns the first
    chunk left to the per-sequence path (B when all were done here, `first` when none)."""
    if len(seq_lens) - first < 2:
        return first
    block_size = kv_cache.shape[2]
    key_ = ("cascade", first)
    shared = step_cache.get(key_) if step_cache is not None else None
    if shared is None:
        shared = _shared_prefix_blocks(block_tables, seq_lens, query_start_loc, first, block_size)
        if step_cache is not None:
            step_cache[key_] = shared
    prefix = shared * block_size
    if prefix < CASCADE_MIN_PREFIX:
        return first
    qs, qe = query_start_loc[first], query_start_loc[-1]
    n_q, hq, d = qe - qs, query.shape[1], query.shape[2]
    if (
        prefix_kernel == "scores"
        and native is not None
        and dtype in (torch.float32, torch.bfloat16)
        and kv_cache.dtype in (torch.float32, torch.float16)
        and kv_cache.is_contiguous()
        and d in (64, 96, 128, 256)
        and prefix % 16 == 0
        and query.dtype == torch.float32
        and query.stride(2) == 1
        and query.stride(1) == d
    ):  # prefix and own keys in one C++ pass per query row
        out[qs:qe] = native.cascade_attention(
            query[qs:qe],
            kv_cache,
            block_tables[first:],
            seq_lens[first:],
            [query_start_loc[i] - qs for i in range(first, len(seq_lens) + 1)],
            prefix,
            scale,
            dtype == torch.bfloat16,
        )
        return len(seq_lens)
    hkv = key.shape[1]
    q_tok = query[qs:qe].to(dtype)  # [Nq, Hq, D]
    q_all = q_tok.transpose(0, 1).contiguous()  # [Hq, Nq, D]
    kp, vp = gather_kv(kv_cache, block_tables[first : first + 1], prefix, dtype, k_scale, v_scale)
    # GQA folded into the rows: each kv head's G query heads as G * Nq rows (no K/V repeat)
    o1, lse1 = flash(q_all.view(1, hkv, -1, d), kp, vp, None, scale)
    o1 = o1.reshape(hq, n_q, d).transpose(0, 1)  # [Nq, Hq, D]
    lse1 = lse1.reshape(hq, n_q).t()
    lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(first, len(seq_lens))]
    if native_prefill is not None:  # every chunk's suffix by the C++ causal kernel, in one call
        o2, lse2 = native_prefill.prefill_attention_many(
            query[qs:qe],
            kv_cache,
            block_tables[first:],
            seq_lens[first:],
            [query_start_loc[i] - qs for i in range(first, len(seq_lens) + 1)],
            [prefix] * len(lens),
            scale,
        )
    elif kv_cache.dtype != torch.float8_e4m3fn and all(
        seq_lens[first + j] - n == prefix for j, n in enumerate(lens)
    ):
        # every suffix is exactly this step's tokens: all chunks in one causal call, padded to
        # the longest (a padded key sits after every real query of its chunk: never seen)
        o2, lse2 = _suffixes_batched(q_tok, key[qs:qe], value[qs:qe], lens, dtype, scale)
    else:
        o2 = torch.empty_like(o1)
        lse2 = torch.empty_like(lse1)
        for i in range(first, len(seq_lens)):
            start, end = query_start_loc[i], query_start_loc[i + 1]
            q_len, ctx = end - start, seq_lens[i]
            rows = slice(start - qs, end - qs)
            k2, v2 = gather_kv(
                kv_cache, block_tables[i : i + 1, shared:], ctx - prefix, dtype, k_scale, v_scale
            )
            q_pos = torch.arange(ctx - q_len, ctx)[:, None]
            kv_pos = torch.arange(prefix, ctx)[None, :]
            mask = torch.zeros(q_len, ctx - prefix, dtype=dtype).masked_fill_(
                kv_pos > q_pos, float("-inf")
            )
            o, lse = flash(q_all[None, :, rows], k2, v2, mask[None, None], scale)
            o2[rows], lse2[rows] = o[0].transpose(0, 1), lse[0].t()
    lse = torch.logaddexp(lse1, lse2)
    w1, w2 = (lse1 - lse).exp_().unsqueeze(-1), (lse2 - lse).exp_().unsqueeze(-1)
    out[qs:qe] = torch.addcmul(o2.float().mul_(w2), o1.float(), w1)
    return len(seq_lens)


@functools.lru_cache(maxsize=16)
def wave_ms(native: Any, dtype: torch.dtype, kernel: str) -> float:
    """ms of cascade_prefill with prefix kernel `kernel` (best of 3 after a warm-up) on a voice
    wave over fp16 pages: 8 chunks of 32 new tokens over a 256-token shared prefix, 4 query heads
    over 2 kv heads of 64 dims; each chunk's own tokens by the C++ causal kernel where `native`
    has it and it was measured faster in `dtype` (edgellm/attention/cpu_dtype.causal_kernel).
    Measured once per process: the prefix kernel's choice and the prefill dtype's share it."""
    from edgellm.attention.cpu_dtype import causal_kernel

    g = torch.Generator().manual_seed(0)
    chunks, turn, prefix, bs = 8, 32, 256, 16
    shared, own = prefix // bs, turn // bs
    cache = torch.randn(2, shared + chunks * own, bs, 2, 64, generator=g).half()
    tables = torch.tensor(
        [list(range(shared)) + [shared + own * i + j for j in range(own)] for i in range(chunks)]
    )
    lens = [prefix + turn] * chunks
    starts = [turn * i for i in range(chunks + 1)]
    q = torch.randn(chunks * turn, 4, 64, generator=g)
    kv = cache[0, shared:].reshape(-1, 2, 64).float()
    native_prefill = native if native is not None and causal_kernel(native, dtype) else None
    out = torch.empty_like(q)

    args = (q, kv, kv, cache, tables, lens, starts, 0, 0.125, 1.0, 1.0, dtype, {}, out)

    def run() -> None:
        cascade_prefill(*args, kernel, native, native_prefill)

    run()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3
