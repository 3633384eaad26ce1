"""OutputBuilder: turns a request's progress into the TokenOutput chunks streamed to callers."""

from __future__ import annotations

from typing import Optional

from common.scheduler.io_struct import TokenOutput
from common.scheduler.req import Req
from common.scheduler.schedule_batch import ModelWorkBatch


class OutputBuilder:
    def add_input_logprobs(self, req: Req, values: Optional[list[float]], work: ModelWorkBatch, i: int) -> None:
        """Record prompt-token logprobs computed by one extend (positions prefix+1 onwards)."""
        if values is None:
            return
        prefix = work.forward_batch.extend_prefix_lens_cpu[i]
        prompt_len = len(req.origin_input_ids)
        for offset, value in enumerate(values):
            position = prefix + 1 + offset
            if position < prompt_len:
                req.input_logprobs.setdefault(position, value)

    def _input_logprob_list(self, req: Req) -> Optional[list[Optional[float]]]:
        if not (req.return_logprob and req.logprob_start_len >= 0) or req.input_logprobs_sent:
            return None
        req.input_logprobs_sent = True
        start = min(req.logprob_start_len, len(req.origin_input_ids))
        return [None if pos == 0 else req.input_logprobs.get(pos)
                for pos in range(start, len(req.origin_input_ids))]

    def build(self, req: Req) -> Optional[TokenOutput]:
        new_ids = req.output_ids[req.sent_len:]
        if not new_ids and not req.finished():
            return None
        start = req.sent_len
        req.sent_len = len(req.output_ids)
        out = TokenOutput(
            rid=req.rid, index=req.index, token_ids=new_ids,
            finished=req.finished(), finish_reason=req.finished_reason,
            prompt_tokens=len(req.origin_input_ids), completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
        )
        if req.error is not None:
            out.error, out.error_code = req.error
        if req.return_logprob:
            out.logprobs = req.output_logprobs[start:]
            if req.top_logprobs_num > 0:
                out.top_logprobs = req.output_top_logprobs[start:]
            if req.prefill_done or req.finished():
                out.input_logprobs = self._input_logprob_list(req)
        return out
