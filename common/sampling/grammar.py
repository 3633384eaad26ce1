"""Grammar-constrained decoding with xgrammar: constraints compiled off the scheduler thread (LRU-cached), one
matcher per request, one token bitmask per batch.

Threads: `GrammarBackend.compile` runs on its own pool; a `RequestGrammar`'s matcher is read and advanced only on
the scheduler thread; a `GrammarMask` is filled on the scheduler thread and read by the model thread, which waits
for it (the overlap loop fills step N+1's mask only after step N's tokens advanced every matcher).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Optional

import torch

from tandem.common.errors import InvalidRequestError
from tandem.common.sampling.xgrammar_tokenizer import grammar_tokenizer_info, import_xgrammar

logger = logging.getLogger(__name__)

# SamplingParams field -> what the constraint is (SGLang's names; the proto's ebnf_grammar is `ebnf`).
CONSTRAINT_KINDS = {"json_schema": "JSON schema", "regex": "regular expression", "ebnf": "EBNF grammar",
                    "structural_tag": "structural tag"}
ANY_JSON = "$$ANY$$"  # SGLang's json_schema for "any JSON value" (OpenAI's response_format json_object)
MASK_WAIT_S = 120.0  # the model thread's bound on waiting for a mask: a scheduler that never fills it is a bug
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'  # xgrammar's character class of a maxLength-bounded JSON string
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'  # what JSON allows unescaped: no quote, backslash or control character
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class GrammarBackend:
    """Compiles (kind, text) constraints for one model's tokenizer on a thread pool; results are cached (LRU).

    xgrammar and the tokenizer's vocabulary are loaded on the pool at the first compile, so a worker that never
    sees a constraint pays nothing for them."""

    def __init__(self, model_path: str, vocab_size: int, stop_token_ids: set[int], any_whitespace: bool = True,
                 threads: int = 2, cache_size: int = 256):
        self.model_path = model_path
        self.any_whitespace = any_whitespace
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self.live_matchers = 0  # matchers made and not yet released (scheduler thread only)
        self.cache_hits = 0

    def compile(self, kind: str, text: str) -> concurrent.futures.Future:
        """A future of the CompiledGrammar; it raises InvalidRequestError naming the field when the text is invalid."""
        key = (kind, text)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return future
            future = self._pool.submit(self._compile, kind, text)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def warm_up(self) -> concurrent.futures.Future:
        """Load xgrammar and the tokenizer's vocabulary now, in the background, instead of at the first compile.

        On a daemon thread, not the pool: the interpreter joins pool threads at exit, so a worker stopped while the
        imports were still running waited seconds for them before it could exit."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def load() -> None:
            try:
                future.set_result(self._grammar_compiler())
            except BaseException as e:  # the first compile raises it again, with its request
                future.set_exception(e)
        threading.Thread(target=load, name="grammar-warm-up", daemon=True).start()
        return future

    def matcher(self, compiled) -> object:
        xgr = import_xgrammar()
        self.live_matchers += 1
        return xgr.GrammarMatcher(compiled)

    def release(self) -> None:
        self.live_matchers -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- on the pool ---------------------------------------------------------------------------

    def _compile(self, kind: str, text: str):
        compiler = self._grammar_compiler()
        try:
            if kind == "json_schema":
                if text == ANY_JSON:
                    return compiler.compile_builtin_json_grammar()
                json.loads(text)  # a precise message for text that is not JSON at all
                return compiler.compile_grammar(self._json_schema_ebnf(text))
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "ebnf":
                return compiler.compile_grammar(text)
            if kind == "structural_tag":
                return _compile_structural_tag(compiler, text)
        except (RuntimeError, ValueError, TypeError, KeyError) as e:
            raise InvalidRequestError(f"{kind}: invalid {CONSTRAINT_KINDS[kind]}: {_clean(e)}", kind) from None
        raise InvalidRequestError(f"unknown constraint kind {kind!r}", "constraint")

    def _json_schema_ebnf(self, schema: str) -> str:
        """xgrammar's grammar for the schema, except that a length-bounded string may not hold a raw control
        character: xgrammar 0.2.8 lets one through there (a tab, say), which is not JSON and fails json.loads and
        pydantic, while its unbounded strings already exclude them."""
        xgr = import_xgrammar()
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=self.any_whitespace, strict_mode=True)
        return str(grammar).replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)

    def _grammar_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                xgr = import_xgrammar()
                # The model's vocab may be larger than the tokenizer's (padded LM head): padding ids are never allowed.
                info = grammar_tokenizer_info(self.model_path, self.vocab_size, self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler


def _compile_structural_tag(compiler, text: str):
    """SGLang's two spellings: {"structures": [{begin, schema, end}], "triggers": [...]} or xgrammar's
    {"type": "structural_tag", "format": {...}}."""
    xgr = import_xgrammar()
    spec = json.loads(text)
    if isinstance(spec, dict) and "structures" in spec:
        tags = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                for s in spec["structures"]]
        return compiler.compile_structural_tag(tags, spec["triggers"])
    return compiler.compile_structural_tag(text)


def _clean(error: Exception) -> str:
    """xgrammar's messages start with a time and a C++ source location; the reader needs the rest."""
    return _XGRAMMAR_LOG_PREFIX.sub("", str(error).strip()) or type(error).__name__


class RequestGrammar:
    """One sequence's constraint: its compile (shared through the cache) and, once started, its own matcher."""

    def __init__(self, backend: GrammarBackend, kind: str, future: concurrent.futures.Future):
        self.backend = backend
        self.kind = kind
        self.future = future
        self.matcher = None

    def ready(self) -> bool:
        return self.future.done()

    def start(self) -> Optional[InvalidRequestError]:
        """Build the matcher once the compile is done; the compile's error when the constraint is invalid."""
        error = self.future.exception()
        if error is not None:
            if isinstance(error, InvalidRequestError):
                return error
            return InvalidRequestError(f"{self.kind}: could not be compiled: {error!r}", self.kind)
        self.matcher = self.backend.matcher(self.future.result())
        return None

    def replay(self, token_ids: list[int]) -> Optional[int]:
        """Advance the started matcher through tokens generated earlier (a resumed request's output so far); the
        index of the first token the grammar refuses, or None when it took them all."""
        for i, token_id in enumerate(token_ids):
            if self.matcher.is_terminated() or not self.matcher.accept_token(token_id):
                return i
        return None

    def accept(self, token_id: int) -> bool:
        return self.matcher is None or self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of the batch's bitmask: the tokens the grammar allows next (all, once it is released)."""
        if self.matcher is not None and not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def release(self) -> None:
        if self.matcher is not None:
            self.matcher = None
            self.backend.release()


class GrammarMask:
    """One step's token bitmask ([B, ceil(V/32)] int32, all ones where a row has no grammar).

    The scheduler thread fills it (`fill`) once every matcher reflects the tokens sampled before this step; the
    model thread waits for it (`wait`) after the forward pass and before sampling."""

    def __init__(self, grammars: list[Optional[RequestGrammar]], vocab_size: int):
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.bitmask = torch.full((len(grammars), (vocab_size + 31) // 32), -1, dtype=torch.int32)
        self._filled = threading.Event()

    @classmethod
    def of(cls, grammars: list[Optional[RequestGrammar]]) -> Optional["GrammarMask"]:
        """A mask for a batch with at least one constrained row, else None (the sampler skips masking)."""
        first = next((g for g in grammars if g is not None), None)
        return None if first is None else cls(grammars, first.backend.vocab_size)

    @property
    def filled(self) -> bool:
        return self._filled.is_set()

    def fill(self) -> None:
        if self._filled.is_set():
            return
        try:
            for row, grammar in enumerate(self.grammars):
                if grammar is not None:
                    grammar.fill(self.bitmask, row)
        finally:
            self._filled.set()  # even on error: the model thread must not wait forever

    def wait(self, device: torch.device) -> torch.Tensor:
        if not self._filled.wait(MASK_WAIT_S):
            raise RuntimeError(f"the grammar mask was not filled within {MASK_WAIT_S:.0f} s")
        return self.bitmask.to(device, non_blocking=True)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> None:
    """Set every logit the bitmask forbids to -inf, in place.

    On CPU, xgrammar's single-threaded kernel, given rows at least as wide as the bitmask's 32-token words: xgrammar
    0.2.8 writes a forbidden word's 32 entries whole, past the row's end when the vocabulary is not a multiple of 32
    (repeated calls with test_grammar.py's 70-token masks corrupted the heap). Elsewhere, the bits unpacked with
    tensor ops (xgrammar's CUDA path needs triton)."""
    width = bitmask.shape[1] * 32
    if not logits.is_cpu or logits.dtype != torch.float32:
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab_size].bool()
        logits[:, :vocab_size].masked_fill_(~allowed, float("-inf"))
        return
    xgr = import_xgrammar()
    if logits.shape[1] >= width and logits.is_contiguous():
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, backend="cpu")
        return
    padded = torch.zeros(logits.shape[0], width, dtype=logits.dtype)
    padded[:, :vocab_size] = logits[:, :vocab_size]
    xgr.apply_token_bitmask_inplace(padded, bitmask, vocab_size=vocab_size, backend="cpu")
    logits[:, :vocab_size] = padded[:, :vocab_size]
