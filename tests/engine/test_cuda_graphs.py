"""Captured decode steps (edgellm/engine/cuda_graphs.py), checked on CPU: the engine's decode
steps run through DecodeGraphs with a backend that replays by running the captured function again
on the static buffers with every host read of a tensor refused (what a real CUDA graph cannot do:
it replays kernels, not Python), through the Triton attention kernels (interpreter). Greedy
tokens must equal the eager engine's, steps of every size must land in their buckets, and the
steps that cannot be graphs (prefill chunks, more sequences than the largest bucket) run eagerly."""

from __future__ import annotations

import pytest
import torch

from edgellm import LLM, SamplingParams
from edgellm.attention.triton import TritonAttention
from edgellm.config import EngineConfig
from edgellm.engine.cuda_graphs import DecodeGraphs, RerunBackend, buckets, cuda_graphs, no_host_reads


def test_host_reads_are_refused_inside_a_capture():
    x = torch.tensor([1.5])
    with no_host_reads():
        for read in (x.item, x.tolist, lambda: bool(x), lambda: int(x), lambda: float(x)):
            with pytest.raises(AssertionError, match="host read"):
                read()
    assert x.item() == 1.5


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert buckets(37) == [1, 2, 4, 8, 16, 24, 32, 37]


def test_enforce_eager_is_the_default_and_makes_no_graphs():
    assert EngineConfig().enforce_eager
    assert cuda_graphs(EngineConfig(), 64) is None
    assert cuda_graphs(EngineConfig(enforce_eager=False), 64) is not None


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma3"])
def test_decode_graphs_give_the_eager_tokens(tiny_dir, monkeypatch, arch):
    """llama; phi3's longrope (the total-length buffer); gemma3's sliding-window pool (its slots
    and tables in buffers of their own), prompts past its window."""
    path, _ = tiny_dir(arch)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 23, 9, 40, 17, 2, 31)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(str(path), kv_cache_memory=1 << 20, max_num_seqs=5, max_model_len=96)
    model = llm.engine.model
    monkeypatch.setattr(model.model, "fused", None)  # the layer path: the backends below
    attn = TritonAttention()
    for layer in model.attention_layers():  # a test's injection: loads choose by device
        monkeypatch.setattr(layer, "backend", attn)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    runner = llm.engine.runner
    backend = RerunBackend()
    assert (runner.window_null is not None) == (arch == "gemma3")
    runner.graphs = DecodeGraphs(model, backend, 5, 96 // 16, 16, runner.null_block, runner.device,
                                 runner.needs_seq_lens, runner.window_null)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert runner.graphs.disabled is None  # no capture failed (a host read would have)
    assert got == want
    # 7 prompts, 5 at a time: decode steps of 5, then fewer as requests finish or wait
    assert backend.replays > 0 and set(runner.graphs.graphs) <= {1, 2, 4, 5}
    assert backend.captures == len(runner.graphs.graphs) >= 2
    again = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params)]  # graphs reused
    assert again == want[:3] and backend.captures == len(runner.graphs.graphs)


def test_a_failed_capture_leaves_every_step_eager(tiny_dir, monkeypatch):
    path, _ = tiny_dir("llama")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(str(path), kv_cache_memory=1 << 20, max_num_seqs=2, max_model_len=64)
    want = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [8, 9]], params)]
    runner = llm.engine.runner  # the CPU decode path reads the step's lengths on the host: refused
    backend = RerunBackend()
    runner.graphs = DecodeGraphs(llm.engine.model, backend, 2, 4, 16, runner.null_block, runner.device)
    assert [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [8, 9]], params)] == want
    assert "host-side lengths" in runner.graphs.disabled
    assert backend.captures == 1 and backend.replays == 0 and not runner.graphs.graphs


def test_only_pure_decode_steps_are_eligible(tiny_dir):
    path, _ = tiny_dir("llama")
    llm = LLM(str(path), kv_cache_memory=1 << 20, max_num_seqs=4, max_model_len=64)
    runner = llm.engine.runner
    graphs = DecodeGraphs(llm.engine.model, RerunBackend(), 4, 4, 16, runner.null_block, runner.device)
    from edgellm.engine.scheduler import ScheduledSeq, SchedulerOutput
    from edgellm.engine.sequence import Sequence

    def step(lens_new):
        items = []
        for i, (n_ctx, n_new) in enumerate(lens_new):
            seq = Sequence(f"r{i}", list(range(3, 3 + n_ctx)), SamplingParams(max_tokens=4), [], 0)
            seq.block_table = list(range(4 * i, 4 * i + -(-n_ctx // 16)))
            seq.num_computed_tokens = n_ctx - n_new
            items.append(ScheduledSeq(seq, n_new))
        return runner.build_batch(SchedulerOutput(items))[0]

    assert graphs.eligible(step([(7, 1), (30, 1)]))
    assert graphs.eligible(step([(7, 1)] * 4))
    assert not graphs.eligible(step([(7, 1)] * 5))  # past the largest bucket
    assert not graphs.eligible(step([(7, 1), (30, 5)]))  # a prefill chunk
