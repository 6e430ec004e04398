"""Paged KV caches for the attention kernels' tests: sequences' pages scattered over a random
cache, their block tables and lengths, and a plain float64 causal softmax reference."""

from __future__ import annotations

import torch


def scattered_tables(g: torch.Generator, nb: int, heads: list[list[int]], own: list[int], bs: int):
    """Block tables [B, W] int64 and lengths for sequences whose tables start with `heads[i]`
    (shared cached pages) followed by `own[i]` fresh pages of an nb-block cache; lengths end at
    varying points of their last page."""
    ids = iter(torch.randperm(nb, generator=g).tolist())
    used = {b for h in heads for b in h}
    free = (b for b in ids if b not in used)
    tables, lens = [], []
    for i, (head, n) in enumerate(zip(heads, own)):
        blocks = head + [next(free) for _ in range(n)]
        tables.append(blocks)
        lens.append(len(head) * bs + (n - 1) * bs + 1 + (i * 5) % bs)
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long), lens


def paged(ctx: int, hkv: int, d: int, bs: int, g: torch.Generator, spare: int = 3):
    """A cache holding one sequence's ctx tokens in shuffled pages (the rest random noise), its
    table, and the K/V it holds in token order."""
    nblocks = -(-ctx // bs)
    cache = torch.randn(2, nblocks + spare, bs, hkv, d, generator=g)
    table = torch.randperm(nblocks + spare, generator=g)[:nblocks]
    k = cache[0, table].reshape(-1, hkv, d)[:ctx]
    v = cache[1, table].reshape(-1, hkv, d)[:ctx]
    return cache, table, k, v


def reference(q, k, v, ctx, key_start, scale):
    """Causal attention in float64 of q [T, Hq, D] (positions ctx - T .. ctx - 1) over k / v
    [ctx, Hkv, D] from key_start on: (out [T, Hq, D], logsumexp [T, Hq])."""
    t, hq, _ = q.shape
    group = hq // k.shape[1]
    kk = k[key_start:].repeat_interleave(group, 1).double()  # [L, Hq, D]
    vv = v[key_start:].repeat_interleave(group, 1).double()
    s = torch.einsum("thd,lhd->htl", q.double(), kk) * scale
    qpos = torch.arange(ctx - t, ctx)[None, :, None]
    kpos = torch.arange(key_start, ctx)[None, None, :]
    s = s.masked_fill(kpos > qpos, float("-inf"))
    lse = torch.logsumexp(s, -1)  # [Hq, T]
    out = torch.einsum("htl,lhd->thd", torch.softmax(s, -1), vv)
    return out, lse.t()
