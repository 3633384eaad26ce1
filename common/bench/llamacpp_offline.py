"""llama.cpp's batched greedy decode on `tandem bench offline`'s workload, through llama-cpp-python's low-level API.

`tandem bench peer --peers llamacpp` writes the GGUF (common/model/quant/gguf_write.py) and runs this file with the
Python that has llama_cpp; it imports nothing from Tandem. One sequence id (and KV stream) per prompt, n_seq_max =
prompts; every prompt is prefilled in one llama_decode call, then each step decodes one token of every sequence.
Prints one JSON line, the shape vllm_offline.py prints: output tokens, seconds, tokens/s."""

import argparse
import json
import os
import random
import sys
import time

INSTALL_HINT = ('llama-cpp-python is not installed in this Python. Build it for this CPU (about 10 minutes on '
                '2 cores): CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36')


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    p.add_argument("--check", action="store_true",
                   help="only check that llama_cpp imports (exit 2 if not) and print its build's system info")
    p.add_argument("--gguf", help="the model as a GGUF file")
    p.add_argument("--dtype", default="", help="reported only: the GGUF's file type (F32, F16, BF16)")
    p.add_argument("--num-prompts", type=int, default=64, help="prompts, all decoded in one batch")
    p.add_argument("--input-len", type=int, default=128, help="random token ids per prompt")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt (greedy, no EOS stop)")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: the usable cores)")
    p.add_argument("--kv", choices=("unified", "per-sequence"), default="per-sequence",
                   help="one stream per sequence (llama.cpp's default), or one KV buffer for all sequences")
    p.add_argument("--flash-attn", choices=("auto", "on", "off"), default="auto", help="llama.cpp's flash attention")
    p.add_argument("--print-tokens", action="store_true", help="also print each sequence's generated ids")
    return p.parse_args(argv)


def random_prompts(vocab: int, num: int, length: int) -> list[list[int]]:
    """vllm_offline.py's prompts: random ids past the first 16 (special tokens live there), seed 0."""
    rng = random.Random(0)
    return [[rng.randrange(16, vocab) for _ in range(length)] for _ in range(num)]


def fill_batch(batch, rows: list[tuple[int, int, int, bool]]) -> None:
    """rows: (token, position, sequence id, wants logits) per batch slot."""
    for i, (token, pos, seq, logits) in enumerate(rows):
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits
    batch.n_tokens = len(rows)


class BatchedGreedy:
    """One llama.cpp context holding every sequence; greedy on the logits of each sequence's last token."""

    def __init__(self, gguf: str, num_seqs: int, max_len: int, threads: int, kv: str = "per-sequence",
                 flash_attn: str = "auto"):
        import llama_cpp as lc
        import numpy as np

        self.lc, self.np = lc, np
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(gguf.encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        params = lc.llama_context_default_params()
        params.n_seq_max = num_seqs
        # llama.cpp's defaults: one KV stream per sequence, so each token attends over its own sequence's cells
        # (a unified buffer of n_ctx cells makes every token scan all of them: 4x slower at 64 x 256, F32), and
        # flash attention where the backend has it.
        params.kv_unified = kv == "unified"
        params.flash_attn_type = {"auto": -1, "off": 0, "on": 1}[flash_attn]
        params.n_ctx = num_seqs * max_len
        params.n_batch = params.n_ctx  # the whole prefill is one llama_decode call (split into ubatches inside)
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {params.n_ctx} tokens, {num_seqs} sequences")
        self.batch = lc.llama_batch_init(params.n_ctx, 0, 1)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> list[int]:
        """Decode `rows`; the argmax of each logits row, in batch order."""
        fill_batch(self.batch, rows)
        status = self.lc.llama_decode(self.ctx, self.batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status} for a batch of {len(rows)} tokens")
        outputs = sum(1 for row in rows if row[3])
        logits = self.np.ctypeslib.as_array(self.lc.llama_get_logits(self.ctx), shape=(outputs, self.vocab))
        return logits.argmax(axis=1).tolist()

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        rows = [(token, pos, seq, pos == len(ids) - 1)
                for seq, ids in enumerate(prompts) for pos, token in enumerate(ids)]
        outputs = [[token] for token in self._decode(rows)]
        for step in range(1, output_len):
            rows = [(out[-1], len(ids) + step - 1, seq, True) for seq, (ids, out) in enumerate(zip(prompts, outputs))]
            for out, token in zip(outputs, self._decode(rows)):
                out.append(token)
        return outputs

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import llama_cpp  # optional: the peer's own build
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    if args.check:  # says how this llama.cpp was built (its CPU features), for the comparison's report
        print("llama.cpp system info: " + llama_cpp.llama_print_system_info().decode().strip())
        return 0
    if not args.gguf:
        print("--gguf is required", file=sys.stderr)
        return 2
    threads = args.threads or len(os.sched_getaffinity(0))
    engine = BatchedGreedy(args.gguf, args.num_prompts, args.input_len + args.output_len, threads, args.kv,
                           args.flash_attn)
    prompts = random_prompts(engine.vocab, args.num_prompts, args.input_len)
    engine.generate([ids[:16] for ids in prompts[:8]], 8)  # warm-up
    start = time.perf_counter()
    outputs = engine.generate(prompts, args.output_len)
    seconds = time.perf_counter() - start
    engine.close()
    tokens = sum(len(out) for out in outputs)
    result = {"system": "llama.cpp", "dtype": args.dtype, "threads": threads, "output_tokens": tokens,
              "seconds": seconds, "tokens_per_s": tokens / seconds}
    if args.print_tokens:
        result["tokens"] = outputs
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
