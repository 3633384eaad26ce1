"""Text generation over the dispatcher: prompt → token ids (chat template, context checks), token deltas →
text deltas (incremental detokenization, stop strings, logprobs). Shared by the HTTP and gRPC APIs."""

from __future__ import annotations

import json
import uuid
from contextlib import aclosing
from typing import AsyncIterator, Callable, Optional

from tandem.common.telemetry.metrics import RequestTimer, RouterMetrics
from tandem.common.telemetry.tracing import (ATTR_INPUT_TOKENS, current_span, request_attributes, router_tokenize_span,
                                             set_attributes)
from tandem.services.router.chat_output import ChatOutputParser, check_tool_choice
from tandem.services.router.detokenizer import IncrementalDetokenizer, StopStringMatcher
from tandem.services.router.dispatch import Dispatcher
from tandem.services.router.errors import ApiError, bad_request
from tandem.services.router.messages import ChoiceDelta, GenerationSpec, LogprobEntry, TokenDelta, TokenRequest, Usage
from tandem.services.router.sessions import SessionRegistry, SessionTurn
from tandem.services.router.tokenizer import TokenizerAssets

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
FALLBACK_CONTEXT_LENGTH = 4096  # when neither the workers nor the tokenizer say


class SequenceText:
    """One choice's text: token ids in (as they stream), text deltas out, trimmed at the first stop."""

    def __init__(self, index: int, assets: TokenizerAssets, spec: GenerationSpec, echo_text: str = "",
                 output: Optional[ChatOutputParser] = None, echo_ids: Optional[list[int]] = None):
        sampling = spec.sampling
        self.index = index
        self.assets = assets
        self.want_logprobs = spec.logprobs is not None
        self.top_k = spec.logprobs or 0  # the workers may send more (vLLM's prompt_logprobs: k asked for more)
        # echo with logprobs: the prompt's tokens lead the choice's logprobs, as its text leads the text; output
        # that comes before the prompt's logprobs (a PD pair's prefill sends them late) waits for them.
        self.echo_ids = echo_ids if spec.echo and self.want_logprobs else None
        self.waiting: list[TokenDelta] = []
        # max_tokens 0 scores the prompt: a PD pair's prefill samples a first token anyway (vLLM too), dropped here.
        self.score_only = sampling.max_tokens == 0
        self.detokenizer = IncrementalDetokenizer(assets.tokenizer, sampling.skip_special_tokens)
        self.stops = StopStringMatcher(sampling.stop)
        self.include_stop = sampling.include_stop_str_in_output
        self.echo_text = echo_text  # completions' echo: the prompt starts the choice's text
        self.output = output  # chat: reasoning and tool calls parsed out of the text
        # A token that may end the sequence is held until the worker says whether it did: its text is not output.
        self.stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(assets.eos_token_ids))
        self.held: Optional[tuple[int, Optional[float], list]] = None
        self.finished = False
        self.tokens = 0
        # A stop string ended the sequence before the end of the worker's tokens: `tokens` counts those used, and
        # the worker's own count (which includes the rest) no longer applies.
        self.trimmed = False

    def on_delta(self, delta: TokenDelta) -> Optional[ChoiceDelta]:
        if self.finished:
            return None
        echo_entries: list[LogprobEntry] = []
        if self.echo_ids is not None:
            if delta.prompt_logprobs is None and not delta.finished:
                self.waiting.append(delta)
                return None
            if delta.prompt_logprobs is None:
                raise ApiError(502, "the workers sent no prompt logprobs for echo with logprobs")
            echo_entries = self._echo_entries(delta.prompt_logprobs)
            delta = _joined(self.waiting + [delta])
            self.echo_ids, self.waiting = None, []
        if self.score_only:
            delta.token_ids, delta.logprobs, delta.top_logprobs = [], [], []
            delta.matched_token_id, delta.completion_tokens = None, 0
        lps = delta.logprobs + [None] * (len(delta.token_ids) - len(delta.logprobs))
        tops = delta.top_logprobs + [[]] * (len(delta.token_ids) - len(delta.top_logprobs))
        items = list(zip(delta.token_ids, lps, tops))
        if self.held is not None:
            items.insert(0, self.held)
            self.held = None
        self.tokens += len(delta.token_ids)
        if delta.finished:
            if items and delta.matched_token_id is not None and items[-1][0] == delta.matched_token_id:
                items.pop()  # the stop token ended the sequence; its text is not part of the output
        elif items and items[-1][0] in self.stop_ids:
            self.held = items.pop()
        text, matched, used = self._feed([t for t, _, _ in items])
        if matched:  # the tokens after the one that completed the stop string are not output, nor counted
            self.tokens -= len(items) - used + (self.held is not None)
            self.trimmed = True
            items, self.held = items[:used], None
        out = ChoiceDelta(self.index, token_ids=[t for t, _, _ in items])
        if delta.finished and not matched:
            tail, matched = self.stops.feed(self.detokenizer.flush())
            text += tail + self.stops.flush()
        if matched and self.include_stop:
            text += self.stops.matched
        out.text, self.echo_text = self.echo_text + text, ""
        if self.want_logprobs:
            out.logprobs = echo_entries + [self._entry(t, lp, top) for t, lp, top in items if lp is not None]
        if matched:
            self.finished, out.finish_reason = True, "stop"
        elif delta.finished:
            self.finished, out.finish_reason = True, delta.finish_reason or "stop"
        if self.output is not None:
            self.output.apply(out, self.finished)
        return out

    def _feed(self, token_ids: list[int]) -> tuple[str, bool, int]:
        """The text of `token_ids` safe to emit, whether a stop string matched, and how many of the tokens were
        used: with stop strings, fed one token at a time so a match ends at the token that completed it, whatever
        the worker's chunking (usage and logprobs count the same tokens for every chunking)."""
        if not self.stops.stops or len(token_ids) <= 1:
            text, matched = self.stops.feed(self.detokenizer.push(token_ids))
            return text, matched, len(token_ids)
        text = ""
        for used, token in enumerate(token_ids, 1):
            piece, matched = self.stops.feed(self.detokenizer.push([token]))
            text += piece
            if matched:
                return text, True, used
        return text, False, len(token_ids)

    def _entry(self, token_id: int, logprob: Optional[float], top: list) -> LogprobEntry:
        text = self.assets.token_text
        return LogprobEntry(token_id, text(token_id), None if logprob is None else _finite(logprob),
                            [(t, text(t), _finite(v)) for t, v in top[:self.top_k]])

    def _echo_entries(self, prompt: list[Optional[float]]) -> list[LogprobEntry]:
        """The prompt's tokens as logprob entries: the first has none (null), the rest their top-k too."""
        tops = getattr(prompt, "top", None) or [[] for _ in prompt]
        return [self._entry(t, lp, top if lp is not None else []) for t, lp, top in zip(self.echo_ids, prompt, tops)]


def _joined(deltas: list[TokenDelta]) -> TokenDelta:
    """Deltas of one sequence held back (echo waiting for the prompt's logprobs) as one; the last one's ending."""
    last = deltas[-1]
    if len(deltas) == 1:
        return last
    out = TokenDelta(last.index, finished=last.finished, finish_reason=last.finish_reason,
                     matched_token_id=last.matched_token_id, prompt_logprobs=last.prompt_logprobs)
    for d in deltas:
        # Padded as on_delta pads one delta: a token without a logprob keeps its place.
        out.logprobs += d.logprobs + [None] * (len(d.token_ids) - len(d.logprobs))
        out.top_logprobs += d.top_logprobs + [[]] * (len(d.token_ids) - len(d.top_logprobs))
        out.token_ids += d.token_ids
    return out


MIN_LOGPROB = -9999.0  # what a masked token's -inf logprob is reported as (vLLM's value): JSON has no -Infinity


def _finite(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB


class TextGenerator:
    """Prompts to token requests, and the workers' token deltas back to text (or chat) deltas."""

    def __init__(self, assets_source: Callable[[], Optional[TokenizerAssets]], dispatcher: Dispatcher,
                 context_length: Callable[[], Optional[int]], metrics: Optional[RouterMetrics] = None,
                 tool_call_parser: Optional[str] = None, reasoning_parser: Optional[str] = None,
                 sessions: Optional[SessionRegistry] = None):
        self._assets = assets_source
        self.sessions = sessions
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.dispatcher = dispatcher
        self._context_length = context_length
        self.metrics = metrics or RouterMetrics(enabled=False)

    @property
    def assets(self) -> TokenizerAssets:
        assets = self._assets()
        if assets is None:
            raise ApiError(503, "the router is starting: its tokenizer is not loaded yet", code="starting")
        return assets

    def context_length(self) -> int:
        return self._context_length() or self.assets.model_max_length or FALLBACK_CONTEXT_LENGTH

    def max_prompt_chars(self) -> int:
        """The longest prompt, in characters, that could fit the context: every token its longest."""
        return self.context_length() * self.assets.max_token_chars

    def check_prompt_chars(self, spec: GenerationSpec) -> None:
        """400 naming the field when the prompt has more characters than can fit the context: cheap (no
        template, no tokenizer), so a huge prompt costs the router neither the memory nor the time of
        tokenizing it (a few hundred bytes a character)."""
        if spec.kind == "chat":
            field = "messages"
            chars = sum(len(json.dumps(message, ensure_ascii=False)) for message in spec.messages or [])
        elif spec.prompt is not None:
            field, chars = "prompt", len(spec.prompt)
        else:
            return  # token ids: their count is checked as it is
        bound = self.max_prompt_chars()
        if chars > bound:
            raise bad_request(field, f"the prompt has {chars} characters, more than can fit the model's context "
                                     f"length ({self.context_length()} tokens of at most "
                                     f"{self.assets.max_token_chars} characters each, {bound} in all)")

    def render_chat(self, spec: GenerationSpec) -> str:
        chat = spec.chat
        return self.assets.chat_template.render(
            spec.messages, add_generation_prompt=chat.add_generation_prompt, tools=chat.tools,
            documents=chat.documents, continue_final_message=chat.continue_final_message, **chat.template_kwargs)

    def prompt_ids(self, spec: GenerationSpec) -> tuple[list[int], str]:
        assets = self.assets
        if spec.kind == "chat":
            text = self.render_chat(spec)
            return assets.encode(text, add_special_tokens=False), text  # the template writes the BOS itself
        if spec.prompt_ids is not None:
            echo = assets.tokenizer.decode(spec.prompt_ids, skip_special_tokens=False) if spec.echo else ""
            return list(spec.prompt_ids), echo
        return assets.encode(spec.prompt or ""), spec.prompt or ""

    def prepare(self, spec: GenerationSpec, request_id: Optional[str] = None) -> TokenRequest:
        """Tokenize and size the request; 400 naming the field when it cannot fit the context. Applies the chat
        template and tokenizes: O(prompt) work that callers on an event loop run on a worker thread."""
        self.check_prompt_chars(spec)
        if spec.kind == "chat":
            check_tool_choice(spec.chat, self.tool_call_parser)
        with router_tokenize_span() as span:
            ids, text = self.prompt_ids(spec)
            set_attributes(span, {ATTR_INPUT_TOKENS: len(ids)})
        field = "messages" if spec.kind == "chat" else "prompt"
        if not ids:
            raise bad_request(field, "the prompt is empty (no tokens)")
        session_turn = None
        if spec.session is not None:
            ids, session_turn = self.session_prompt(spec, ids)
        context = self.context_length()
        room = context - len(ids)
        if room < (0 if spec.sampling.max_tokens == 0 else 1):  # max_tokens 0 scores the prompt: no room needed
            raise bad_request(field, f"the prompt has {len(ids)} tokens; the model's context length is {context}, "
                                     f"which leaves no room for output")
        max_field = "max_completion_tokens" if spec.kind == "chat" else "max_tokens"
        max_tokens = spec.sampling.max_tokens
        if max_tokens is None:
            max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, room) if spec.kind == "completion" else room
        elif max_tokens > room:
            raise bad_request(max_field, f"the prompt ({len(ids)} tokens) plus {max_field} ({max_tokens}) exceeds "
                                         f"the model's context length ({context}); ask for at most {room}")
        if spec.sampling.min_tokens > max_tokens:
            raise bad_request("min_tokens", f"must be <= the maximum output length ({max_tokens})")
        request_id = request_id or f"{'chatcmpl' if spec.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        set_attributes(current_span(), {**request_attributes(spec.model, max_tokens, spec.sampling.temperature,
                                                             request_id), ATTR_INPUT_TOKENS: len(ids)})
        return TokenRequest(
            request_id=request_id, input_ids=ids, sampling=spec.sampling, max_new_tokens=max_tokens,
            top_logprobs=max(spec.logprobs or 0, spec.prompt_top_logprobs), return_logprob=spec.logprobs is not None,
            prompt_logprobs=spec.prompt_logprobs or (spec.echo and spec.logprobs is not None), original_text=text,
            constraint=spec.constraint, session=session_turn)

    def session_prompt(self, spec: GenerationSpec, ids: list[int]) -> tuple[list[int], SessionTurn]:
        """A session turn's whole prompt (its parent's context, then `ids`) and its SessionTurn; 400 naming the
        field when the session cannot take it."""
        if self.sessions is None:
            raise bad_request("session_params", "sessions are not served here")
        if spec.sampling.n != 1:
            raise bad_request("n", "a session turn is one sequence: n must be 1 with session_params")
        if spec.echo:
            raise bad_request("echo", "cannot echo a session turn's prompt (it holds the session's context)")
        session = self.sessions.get(spec.session.id)
        return session.begin(spec.session, ids, self.assets.bos_token_id)

    def finish_turn(self, req: TokenRequest, output_ids: list[int]) -> None:
        """The session turn finished: its prompt and output join the session (unless it was closed meanwhile)."""
        session = self.sessions.sessions.get(req.session.session_id)
        if session is not None:
            session.finish(req.request_id, req.session, req.input_ids + output_ids)

    def _sequence(self, index: int, assets: TokenizerAssets, spec: GenerationSpec, req: TokenRequest) -> SequenceText:
        output = None
        if spec.kind == "chat" and (self.reasoning_parser or spec.chat.tools):
            output = ChatOutputParser(spec.chat, self.tool_call_parser, self.reasoning_parser)
        return SequenceText(index, assets, spec, req.original_text if spec.echo else "", output, req.input_ids)

    async def stream(self, spec: GenerationSpec, req: TokenRequest, usage: Usage,
                     timer: Optional[RequestTimer] = None) -> AsyncIterator[ChoiceDelta]:
        """Text deltas of every choice until each has finished; `usage` is filled in as they come, and
        `timer` (the router's request metrics) sees every token and the ending."""
        assets = self.assets
        sequences = {i: self._sequence(i, assets, spec, req) for i in range(spec.sampling.n)}
        usage.prompt_tokens = len(req.input_ids)
        reported: dict[int, int] = {}
        output_ids: list[int] = []  # a session turn's output, for the session's next turn
        reason = "abort"  # unless every sequence finishes (or an error says otherwise)
        try:
            async with aclosing(self.dispatcher.generate(req)) as deltas:
                async for delta in deltas:
                    seq = sequences.get(delta.index)
                    if seq is None:
                        raise ApiError(500, f"worker sent sequence index {delta.index} for n={spec.sampling.n}")
                    if timer is not None:
                        timer.tokens(len(delta.token_ids))
                    output_ids.extend(delta.token_ids)
                    usage.cached_tokens = max(usage.cached_tokens, delta.cached_tokens)
                    usage.weight_version = usage.weight_version or delta.weight_version
                    if delta.prompt_logprobs is not None:
                        usage.prompt_logprobs = delta.prompt_logprobs
                    if delta.finished and delta.completion_tokens and not seq.finished and not seq.score_only:
                        reported[delta.index] = delta.completion_tokens
                    out = seq.on_delta(delta)
                    if seq.trimmed:
                        reported.pop(delta.index, None)
                    if out is not None:  # the counts at this delta, for continuous usage
                        out.prompt_tokens = usage.prompt_tokens
                        out.completion_tokens = reported.get(delta.index, seq.tokens)
                    if out is not None and out.finish_reason:
                        reason = out.finish_reason
                    if out is not None and (out.text or out.logprobs or out.finish_reason or out.token_ids):
                        yield out
                    if all(s.finished for s in sequences.values()):
                        break  # stop strings may end sequences before the worker does: leaving cancels it
        except ApiError:
            reason = "error"
            raise
        finally:
            usage.completion_tokens = sum(reported.get(i, s.tokens) for i, s in sequences.items())
            if not all(s.finished for s in sequences.values()) and reason != "error":
                reason = "abort"
            if timer is not None:
                timer.finish(reason, usage.prompt_tokens, usage.completion_tokens)
        if req.session is not None and reason not in ("abort", "error"):
            self.finish_turn(req, output_ids)
        self.metrics.observe_usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
