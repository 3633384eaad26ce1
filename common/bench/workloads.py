"""Request generators for `tandem bench serve`: random, shared-prefix, multi-turn and ShareGPT workloads."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from tandem.common.tokenizer import build_backend

# Short, common English words: each is one token (with its leading space) in most BPE vocabularies,
# so a prompt of N words is roughly N tokens whatever the server's tokenizer.
VOCABULARY: tuple[str, ...] = tuple("""
the of and to in is was for on are with as at be by this had not but from or have an they which one
you were all we when there can more if out so said what up its about into than them only other new
some could time these two may then do first any my now such like our over man me even most made after
also did many before must through back years where much your way well down should because each just
those people how too little state good very make world still own see men work long get here between
both life being under never day same another know while last might us great old year off come since
against go came right used take three states himself few house use during without again place around
however home small found thought went say part once general high upon school every does got united left
number course war until always away something fact though water less public put think almost hand enough
far took head yet government system better set told nothing night end why called didn find look asked
later knew point next program city business give group toward young days let room president side social
given present several order national possible rather second face per among form important often things
""".split())

# ShareGPT replies are measured in words when no tokenizer is given; English averages ~1.3 tokens a word.
TOKENS_PER_WORD = 1.3


@dataclass
class BenchRequest:
    """One prompt to send. `system` (shared-prefix) becomes a system message on the chat endpoint."""

    prompt: str
    prompt_len: int  # estimated input tokens; the server's usage count replaces it when reported
    output_len: int  # max_tokens
    system: str = ""
    group: int = -1  # shared-prefix group or multi-turn conversation, -1 otherwise
    history: tuple[dict, ...] = ()  # multi-turn: the earlier turns' {"role", "content"} messages, oldest first

    def full_prompt(self) -> str:
        """The prompt as one text (completions endpoint): system, earlier turns and this turn, in order."""
        parts = ([self.system] if self.system else []) + [m["content"] for m in self.history] + [self.prompt]
        return "\n\n".join(parts)


def random_words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(count))


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Lengths are drawn uniformly from [length * range_ratio, length]; ratio 1.0 means exactly `length`."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    return max(1, round(length * range_ratio)), max(1, length)


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                    seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    requests = []
    for _ in range(num_prompts):
        n_in = rng.randint(in_lo, in_hi)
        requests.append(BenchRequest(prompt=random_words(rng, n_in), prompt_len=n_in,
                                     output_len=rng.randint(out_lo, out_hi)))
    return requests


def shared_prefix_requests(num_prompts: int, num_groups: int, prefix_len: int, suffix_len: int,
                           output_len: int, seed: int) -> list[BenchRequest]:
    """Request i belongs to group i % num_groups, so groups interleave and the cache must hold them all."""
    if num_groups < 1:
        raise ValueError(f"--num-groups must be >= 1, got {num_groups}")
    rng = random.Random(seed)
    prefixes = [f"System prompt {g}: " + random_words(rng, prefix_len) for g in range(num_groups)]
    requests = []
    for i in range(num_prompts):
        group = i % num_groups
        # The request index up front keeps two suffixes from ever being equal.
        suffix = f"Question {i}: " + random_words(rng, suffix_len)
        requests.append(BenchRequest(prompt=suffix, prompt_len=prefix_len + suffix_len + 6,
                                     output_len=output_len, system=prefixes[group], group=group))
    return requests


def multi_turn_requests(num_conversations: int, num_turns: int, turn_len: int, reply_len: int,
                        output_len: int, seed: int) -> list[BenchRequest]:
    """Conversations whose every turn re-sends the whole history: turn t carries the t earlier user turns and a
    `reply_len`-word assistant reply after each (fixed, so the prompts do not depend on what the server answered).

    Turn-major order: every conversation's turn 1, then every turn 2, ... With at most `num_conversations` requests
    in flight, a turn starts only after its conversation's previous turn finished; between two turns of one
    conversation come all the others', so the cache must hold every conversation to hit."""
    if num_conversations < 1 or num_turns < 1:
        raise ValueError(f"--num-conversations and --num-turns must be >= 1, got {num_conversations}, {num_turns}")
    rng = random.Random(seed)
    histories: list[list[dict]] = [[] for _ in range(num_conversations)]
    requests = []
    for turn in range(num_turns):
        for conv, history in enumerate(histories):
            # The conversation and turn up front keep two conversations from ever sharing a prefix.
            user = f"Conversation {conv} turn {turn}: " + random_words(rng, turn_len)
            prior_words = sum(len(m["content"].split()) for m in history)
            requests.append(BenchRequest(prompt=user, prompt_len=prior_words + turn_len + 4, output_len=output_len,
                                         group=conv, history=tuple(history)))
            history += [{"role": "user", "content": user},
                        {"role": "assistant", "content": random_words(rng, reply_len)}]
    return requests


def word_token_counter(text: str) -> int:
    return max(1, round(len(text.split()) * TOKENS_PER_WORD))


def load_token_counter(tokenizer_path: str | None) -> Callable[[str], int]:
    """A tokenizer.json (or a model directory holding one) when given, else the words x 1.3 estimate."""
    if not tokenizer_path:
        return word_token_counter
    path = Path(tokenizer_path)
    if not (path / "tokenizer.json" if path.is_dir() else path).is_file():
        raise ValueError(f"--tokenizer: no tokenizer.json at {path}")
    # A model directory is tokenized as the router tokenizes it (its model type may rebuild tokenizer.json's
    # pre-tokenizer); a bare tokenizer.json as it is.
    tokenizer = build_backend(str(path)) if path.is_dir() else Tokenizer.from_file(str(path))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def parse_sharegpt(entries: list, count_tokens: Callable[[str], int],
                   min_len: int = 4, max_prompt_len: int = 4096) -> list[BenchRequest]:
    """First human turn is the prompt; the gpt reply that follows sets max_tokens."""
    requests = []
    for entry in entries:
        turns = entry.get("conversations", []) if isinstance(entry, dict) else []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        prompt, reply = str(turns[0].get("value", "")), str(turns[1].get("value", ""))
        prompt_len, output_len = count_tokens(prompt), count_tokens(reply)
        # Very short turns say little about serving speed; very long prompts overflow small contexts.
        if prompt_len < min_len or output_len < min_len or prompt_len > max_prompt_len:
            continue
        requests.append(BenchRequest(prompt=prompt, prompt_len=prompt_len, output_len=output_len))
    return requests


def sharegpt_requests(path: str, num_prompts: int, seed: int,
                      tokenizer_path: str | None = None) -> list[BenchRequest]:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--dataset-path {path!r} is not a file")
    try:
        entries = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"--dataset-path {path!r} is not valid JSON: {e}") from e
    if not isinstance(entries, list):
        raise ValueError(f"--dataset-path {path!r}: expected a JSON list of conversations")
    requests = parse_sharegpt(entries, load_token_counter(tokenizer_path))
    if not requests:
        raise ValueError(f"--dataset-path {path!r}: no usable human->gpt conversations")
    random.Random(seed).shuffle(requests)
    return requests[:num_prompts]
