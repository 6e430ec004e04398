"""GGUF (llama.cpp) weight blocks -> integer codes with group scales, for the int4/int8 kernels.

Each decoder reads a tensor's raw rows ([N, K / block * block_bytes] uint8) the way gguf-py's
reference dequantizer does (gguf/quants.py) and returns the codes with per-group scales (and
offsets) such that Int4Codes/Int8Codes.dequantize() is bit-equal to that dequantizer: every
scale below is a product of an fp16 and a small integer, exact in fp32, so code * scale is
exact and the offset (a minimum) is the one rounding, as it is there.

    type     bits/weight  codes                 group  W
    Q4_0     4.5          int4 0..15            32     d * (q - 8)
    Q4_1     5            int4 0..15            32     d * q + m
    Q4_K     4.5          int4 0..15            32     (d * sc) * q - dmin * m   (6-bit sc, m)
    Q5_0     5.5          int8 -16..15          32     d * q
    Q5_1     6            int8 0..31            32     d * q + m
    Q5_K     5.5          int8 0..31            32     (d * sc) * q - dmin * m
    Q6_K     6.6          int8 -32..31          16     (d * sc) * q               (int8 sc)
    Q3_K     3.4          int8 -4..3            16     (d * (sc - 32)) * q        (6-bit sc)
    Q2_K     2.6          int8 0..3             16     (d * sc) * q - dmin * m    (4-bit sc, m)
    Q8_0     8.5          int8                  32     d * q
    IQ4_NL   4.5          int8 (a 16-value grid) 32    d * grid[q]
    IQ4_XS   4.25         int8 (the same grid)  32     (d * (ls - 32)) * grid[q] (6-bit ls)

int4 types map to Int4Codes (the int4 kernels, also on CUDA for Q4_0); every type maps to
Int8Codes, so a fused module whose shards mix types (Q4_K_M's q/k in Q4_K with v in Q6_K)
stays quantized as int8 codes.
"""

from __future__ import annotations

import torch

from edgellm.quant.int_codes import Int4Codes, Int8Codes, SplitScales

QK_K = 256
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "Q8_0", "IQ4_NL", "IQ4_XS")
SUPPORTED = INT4_TYPES + INT8_TYPES
IQ4_GRID = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
BLOCK_BYTES = {
    "Q4_0": 18,
    "Q4_1": 20,
    "Q4_K": 144,
    "Q5_0": 22,
    "Q5_1": 24,
    "Q5_K": 176,
    "Q6_K": 210,
    "Q3_K": 110,
    "Q2_K": 84,
    "Q8_0": 34,
    "IQ4_NL": 18,
    "IQ4_XS": 136,
}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] fp32 (little-endian fp16)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: the n low nibbles, then the n high ones."""
    return torch.cat((qs & 15, qs >> 4), -1)


def _bits(b: torch.Tensor, count: int, step: int, width: int) -> torch.Tensor:
    """[..., n] bytes -> [..., count, n]: field i is (b >> (i * step)) & (2^width - 1)."""
    shifts = torch.arange(count, dtype=torch.uint8) * step
    return (b.unsqueeze(-2) >> shifts[:, None]) & ((1 << width) - 1)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes -> (sc [nb, 8], m [nb, 8]), 6 bits each."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), -1)
    mn = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), -1)
    return sc.float(), mn.float()


def _blocks(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    size = BLOCK_BYTES[type_name]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % size:
        raise ValueError(
            f"GGUF {type_name}: rows must be uint8 [N, blocks * {size}], got "
            f"{raw.dtype} {tuple(raw.shape)}"
        )
    return raw.reshape(-1, size)


def decode(
    raw: torch.Tensor, type_name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """Rows [N, row bytes] -> (codes [N, K] int16, scale [N, G] fp32, offset [N, G] fp32 or None,
    group), W = codes * scale + offset per group (see the module table)."""
    return _decode(raw, type_name)[:4]


def _decode(raw: torch.Tensor, type_name: str) -> tuple:
    """decode's tuple, then the scales and the offsets as SplitScales (the K-quants' and IQ4_XS'
    d * sc: an fp16 per 256 columns times a small integer per group; None for the other types)."""
    if type_name not in SUPPORTED:
        raise ValueError(
            f"GGUF type {type_name!r} has no integer decoding; supported: {', '.join(SUPPORTED)}"
        )
    n = raw.shape[0]
    b = _blocks(raw, type_name)
    nb = b.shape[0]
    offset = None
    splits: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]  # (base, mult) per block
    if type_name in ("Q4_0", "Q4_1", "IQ4_NL"):
        head = 4 if type_name == "Q4_1" else 2
        q = _nibbles(b[:, head:]).short()
        scale = _f16(b[:, 0:2])[:, None]
        if type_name == "Q4_0":
            q, offset = q - 8, None
        elif type_name == "Q4_1":
            offset = _f16(b[:, 2:4])[:, None]
        else:
            q = torch.tensor(IQ4_GRID, dtype=torch.int16)[q.long()]
        group = 32
    elif type_name in ("Q5_0", "Q5_1"):
        head = 4 if type_name == "Q5_1" else 2
        qh = (
            _bits(b[:, head : head + 4], 8, 1, 1).transpose(-1, -2).reshape(nb, 32)
        )  # bit i of the uint32
        q = (_nibbles(b[:, head + 4 :]) | (qh << 4)).short()
        scale = _f16(b[:, 0:2])[:, None]
        if type_name == "Q5_0":
            q = q - 16
        else:
            offset = _f16(b[:, 2:4])[:, None]
        group = 32
    elif type_name == "Q8_0":
        q = b[:, 2:].contiguous().view(torch.int8).short()
        scale, group = _f16(b[:, 0:2])[:, None], 32
    elif type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
        sc, mn = _scale_min_k4(b[:, 4:16])
        qs = b[:, 48:] if type_name == "Q5_K" else b[:, 16:]
        q = _bits(qs.reshape(nb, 4, 32), 2, 4, 4).reshape(
            nb, 8, 32
        )  # sub-block 2i + h: nibble h of chunk i
        if type_name == "Q5_K":
            q = q | (
                _bits(b[:, 16:48], 8, 1, 1) << 4
            )  # sub-block j: bit j of the 32 high-bit bytes
        q = q.reshape(nb, QK_K).short()
        scale, offset, group = d * sc, -(dmin * mn), 32
        splits = [(d, sc), (-dmin, mn)]
    elif type_name == "Q6_K":
        ql = _bits(b[:, 0:128].reshape(nb, 2, 64), 2, 4, 4).reshape(nb, 8, 32)
        qh = _bits(b[:, 128:192].reshape(nb, 2, 32), 4, 2, 2).reshape(nb, 8, 32)
        q = (ql | (qh << 4)).reshape(nb, QK_K).short() - 32
        d, sc = _f16(b[:, 208:210])[:, None], b[:, 192:208].contiguous().view(torch.int8).float()
        scale, group, splits[0] = d * sc, 16, (d, sc)
    elif type_name == "Q3_K":
        hmask, qs, s = b[:, 0:32], b[:, 32:96], b[:, 96:108]
        low = _bits(s[:, 0:8], 2, 4, 4).reshape(nb, 16)
        high = _bits(s[:, 8:12], 4, 2, 2).reshape(nb, 16)
        sc = ((low | (high << 4)).short() - 32).float()
        ql = _bits(qs.reshape(nb, 2, 32), 4, 2, 2).reshape(nb, 16, 16)
        qh = (
            _bits(hmask, 8, 1, 1).reshape(nb, 16, 16) ^ 1
        )  # the 4 is subtracted where the mask bit is 0
        q = (ql.short() - (qh.short() << 2)).reshape(nb, QK_K)
        d = _f16(b[:, 108:110])[:, None]
        scale, group, splits[0] = d * sc, 16, (d, sc)
    elif type_name == "Q2_K":
        s = b[:, 0:16]
        d, dmin = _f16(b[:, 80:82])[:, None], _f16(b[:, 82:84])[:, None]
        q = _bits(b[:, 16:80].reshape(nb, 2, 32), 4, 2, 2).reshape(nb, QK_K).short()
        sc, mn = (s & 15).float(), (s >> 4).float()
        scale, offset, group = d * sc, -(dmin * mn), 16
        splits = [(d, sc), (-dmin, mn)]
    else:  # IQ4_XS
        d = _f16(b[:, 0:2])[:, None]
        sh = b[:, 2:4].long()
        sh = sh[:, 0] | (sh[:, 1] << 8)
        sl = (
            _bits(b[:, 4:8], 2, 4, 4).transpose(-1, -2).reshape(nb, 8)
        )  # sub-block 2i + h: nibble h of byte i
        hi = (sh[:, None] >> (2 * torch.arange(8))) & 3
        ls = (sl.long() | (hi << 4)) - 32
        q = _nibbles(b[:, 8:].reshape(nb, 8, 16)).reshape(nb, QK_K)
        q = torch.tensor(IQ4_GRID, dtype=torch.int16)[q.long()]
        scale, group, splits[0] = d * ls.float(), 32, (d, ls.float())
    codes = q.reshape(n, -1)
    scale = scale.reshape(n, -1).contiguous()
    offset = None if offset is None else offset.reshape(n, -1).contiguous()
    # (-dmin) * m == -(dmin * m) and d * sc are exact: the split forms stand for these values
    split = [
        None if p is None else SplitScales(p[1].reshape(n, -1).to(torch.int8), p[0].reshape(n, -1))
        for p in splits
    ]
    return codes, scale, offset, group, split[0], split[1]


def int4_codes(raw: torch.Tensor, type_name: str) -> Int4Codes:
    """An int4 type (INT4_TYPES) as Int4Codes with offsets (W = scale * q + offset, codes 0..15);
    Q4_0 as plain symmetric codes (zeros None, no offsets: W = d * (q - 8))."""
    if type_name not in INT4_TYPES:
        raise ValueError(f"GGUF {type_name} is not an int4 type ({', '.join(INT4_TYPES)})")
    if type_name == "Q4_0":
        b = _blocks(raw, type_name)
        codes = _nibbles(b[:, 2:]).reshape(raw.shape[0], -1)
        return Int4Codes(codes, None, _f16(b[:, 0:2]).reshape(raw.shape[0], -1), 32)
    codes, scale, offset, group, ssplit, osplit = _decode(raw, type_name)
    return Int4Codes(
        codes.to(torch.uint8),
        None,
        scale,
        group,
        offsets=offset,
        scale_split=ssplit,
        offset_split=osplit,
    )


def int8_codes(raw: torch.Tensor, type_name: str, group: int | None = None) -> Int8Codes:
    """Any SUPPORTED type as Int8Codes; `group` (16) splits its groups further (scales repeated:
    exact), so shards of different types concatenate."""
    codes, scale, offset, own, ssplit, osplit = _decode(raw, type_name)
    group = group or own
    if own % group:
        raise ValueError(f"GGUF {type_name}: groups of {own} cannot be split into {group}")
    rep = own // group
    if rep > 1:
        scale = scale.repeat_interleave(rep, 1)
        offset = None if offset is None else offset.repeat_interleave(rep, 1)
        ssplit = None if ssplit is None else ssplit.repeat_groups(rep)
        osplit = None if osplit is None else osplit.repeat_groups(rep)
    return Int8Codes(
        codes.to(torch.int8).contiguous(),
        scale,
        group,
        offsets=offset,
        scale_split=ssplit,
        offset_split=osplit,
    )


def concat_int8(parts: list[Int8Codes]) -> Int8Codes:
    """Row-wise concatenation of Int8Codes with one group size (offsets 0 where a part has none)."""
    group = parts[0].group_size
    assert all(p.group_size == group for p in parts)
    offsets = None
    if any(p.offsets is not None for p in parts):
        offsets = torch.cat(
            [
                p.offsets if p.offsets is not None else torch.zeros_like(p.scales.float())
                for p in parts
            ],
            0,
        )
    return Int8Codes(
        torch.cat([p.codes for p in parts], 0),
        torch.cat([p.scales.float() for p in parts], 0),
        group,
        offsets=offsets,
        scale_split=SplitScales.cat([p.scale_split for p in parts]),
        offset_split=None if offsets is None else SplitScales.cat(_offset_splits(parts)),
    )


def _offset_splits(parts: list[Int8Codes]) -> list[SplitScales | None]:
    """Each part's offsets in split form; a part without offsets but with split scales as zeros."""
    out = []
    for p in parts:
        s = p.scale_split
        if p.offsets is not None or s is None:
            out.append(p.offset_split if p.offsets is not None else None)
        else:
            out.append(SplitScales(torch.zeros_like(s.mult), torch.zeros_like(s.base)))
    return out


def group_of(type_name: str) -> int:
    return 16 if type_name in ("Q6_K", "Q3_K", "Q2_K") else 32
