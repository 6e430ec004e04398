"""The compute floor of a prefill step (edgellm/bench/compute_floor.py): multiply-adds counted from
a loaded model against a count from its transformers config, and measured matmul rates."""

from __future__ import annotations

import math

import pytest

from edgellm import LLM
from edgellm.bench.compute_floor import floor_ms, matmul_rates, prefill_macs
from tests.helpers.tiny_models import build_tiny


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prefill_macs_count_every_linear_and_the_keys_each_token_sees(arch, tmp_path):
    path, hf = build_tiny(arch, tmp_path / arch)
    cfg = hf.config
    llm = LLM(str(path), kv_cache_memory=1 << 20, max_num_seqs=2)
    heads, hd, hidden, inter = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * hd
    per_layer = hidden * (heads * hd + 2 * kv) + heads * hd * hidden + hidden * 2 * inter + inter * hidden
    new, ctx = [5, 30], [40, 30]  # 5 new tokens after 35 cached; a cold 30-token prompt
    windows = [cfg.sliding_window if t == "sliding_attention" else None
               for t in getattr(cfg, "layer_types", ["full_attention"] * cfg.num_hidden_layers)]
    keys = sum(min(p + 1, w or p + 1) for w in windows for t, c in zip(new, ctx) for p in range(c - t, c))
    got = prefill_macs(llm.engine.runner.model, new, ctx)
    assert got["linears"] == pytest.approx(sum(new) * per_layer * cfg.num_hidden_layers / 1e9, rel=1e-12)
    assert got["attention"] == pytest.approx(keys * heads * hd * 2 / 1e9, rel=1e-12)
    if arch == "gemma3":  # the window matters: fewer keys than every layer global would see
        global_keys = sum(p + 1 for t, c in zip(new, ctx) for p in range(c - t, c)) * len(windows)
        assert got["attention"] < global_keys * heads * hd * 2 / 1e9


def test_matmul_rates_and_the_floor():
    rates = matmul_rates(m=64, k=256, n=256, reps=2)
    assert {"fp32", "bf16"} <= set(rates) and all(r > 0 and math.isfinite(r) for r in rates.values())
    fl = floor_ms({"linears": 2.0, "attention": 0.5}, {"int8": 100.0, "bf16": 50.0, "fp32": 25.0}, "bf16")
    assert fl == pytest.approx({"linears": 20.0, "attention": 10.0, "total": 30.0})
    assert math.isnan(floor_ms({"linears": 1.0, "attention": 1.0}, {"fp32": 1.0}, "fp32")["linears"])
