"""A plain transformers server behind the same OpenAI API as `edgellm serve`: the baseline
that `benchmarks/compare_servers.py` measures edgellm against.

Static batching, the way a straightforward transformers deployment serves: requests
that arrive within a short window (--batch-window-ms, up to --max-batch-size) form one
batch; the prompts are left-padded and run through `model.generate()` together, and
nothing new joins until the whole batch has finished. A streamer receives the batch's
new token column every step and pushes each row's text delta to that request's queue,
so every client streams as its tokens appear. Per request: `max_tokens`, `ignore_eos`
and `temperature` (0 = greedy; per-row temperatures through a logits processor).

    python benchmarks/hf_baseline_server.py                          # the embedded default GGUF
    python benchmarks/hf_baseline_server.py --model ./hf-dir --port 8001
    python benchmarks/hf_baseline_server.py --model model.gguf --max-batch-size 16

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming or not),
GET /v1/models, GET /health. 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch

from edgellm.bench.hf_baseline import DEFAULT_NAME, create_app
from edgellm.bench.hf_batching import load

logger = logging.getLogger("hf_baseline")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="an HF directory or a .gguf file (default: the embedded model)")
    ap.add_argument("--served-model-name", default=DEFAULT_NAME)
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--batch-window-ms", type=float, default=20.0,
                    help="how long the first request of a batch waits for others to join")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = ap.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    t = time.perf_counter()
    model, tokenizer = load(args.model, getattr(torch, args.dtype))
    logger.info("loaded %s in %.1fs (%s, %d torch threads)", args.model or "the default model",
                time.perf_counter() - t, args.dtype, torch.get_num_threads())
    app = create_app(model, tokenizer, args.served_model_name, args.max_batch_size, args.batch_window_ms)

    import uvicorn

    logger.info("serving on http://127.0.0.1:%d", args.port)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
