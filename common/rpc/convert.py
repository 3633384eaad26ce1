"""Conversions at the gRPC edge: SglangScheduler protobuf messages <-> the engine's dataclasses."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.common.errors import InvalidRequestError
from tandem.common.sampling.params import SamplingParams, token_id_key
from tandem.common.scheduler.io_struct import GenerateRequest, SequenceResult, TokenOutput

DEFAULT_MAX_NEW_TOKENS = 128

# GenerateRequest fields this engine cannot honour: proto field -> why.
_UNSUPPORTED_REQUEST_FIELDS = {
    "mm_inputs": "multimodal inputs are not supported (text-only models)",
    "input_embeds": "input embeddings are not supported; send tokenized.input_ids",
    "token_ids_logprob": "token_ids_logprob is not supported; use top_logprobs_num",
    "return_hidden_states": "hidden states are not returned by this engine",
    "custom_logit_processor": "custom logit processors are not supported",
}
# The proto's constraint oneof -> SamplingParams' field (SGLang's names).
_CONSTRAINT_FIELDS = {"regex": "regex", "json_schema": "json_schema", "ebnf_grammar": "ebnf",
                      "structural_tag": "structural_tag"}
# custom_params keys we understand; anything else is rejected so typos do not pass silently.
_CUSTOM_PARAMS = {"seed"}


def _reject(field: str, message: str) -> None:
    raise InvalidRequestError(f"{field}: {message}", field)


def check_unsupported(req: pb.GenerateRequest) -> None:
    """Raise InvalidRequestError naming the first request field this engine does not support."""
    for field, why in _UNSUPPORTED_REQUEST_FIELDS.items():
        value = getattr(req, field)
        present = req.HasField(field) if field == "mm_inputs" else bool(value)
        if present:
            _reject(field, why)
    sp = req.sampling_params
    if sp.stop:
        # smg matches stop strings itself (single-token ones arrive as stop_token_ids) and never sends
        # them; a client that does expects the engine to apply them, and this engine cannot.
        _reject("sampling_params.stop", "stop strings are applied by the gateway, not the worker; send "
                "stop_token_ids, or route through a gateway that detokenizes")
    if req.HasField("data_parallel_rank") and req.data_parallel_rank != 0:
        _reject("data_parallel_rank", f"this worker has one data-parallel rank (0), got {req.data_parallel_rank}")


def check_embed_request(req: pb.EmbedRequest) -> None:
    """Raise InvalidRequestError naming the first EmbedRequest field this engine does not support (sampling_params
    is the proto's documented dummy and is not read)."""
    if req.HasField("mm_inputs"):
        _reject("mm_inputs", "multimodal inputs are not supported (text-only models)")
    if req.is_cross_encoder or req.texts:
        _reject("is_cross_encoder", "cross-encoder scoring is not supported; this worker embeds decoder prompts")
    if req.token_type_ids:
        _reject("token_type_ids", "token type ids are not used by decoder models")
    if req.data_parallel_rank != 0:
        _reject("data_parallel_rank", f"this worker has one data-parallel rank (0), got {req.data_parallel_rank}")


def sampling_params_from_proto(sp: pb.SamplingParams, prompt_len: int, max_context_len: int) -> SamplingParams:
    """Proto3 zeros are "unset" where zero is not a meaningful value (top_p, repetition_penalty, n, top_k).

    temperature is taken literally: 0 means greedy, and the gateway always sends the value it resolved.
    """
    seed = _seed(sp)
    if sp.HasField("max_new_tokens"):
        max_new_tokens = sp.max_new_tokens
    else:
        max_new_tokens = max(min(DEFAULT_MAX_NEW_TOKENS, max_context_len - prompt_len), 0)
    logit_bias: dict[int, float] = {}
    for key, bias in sp.logit_bias.items():
        token_id = token_id_key(key)
        if token_id is None:
            _reject("logit_bias", f"logit_bias key {key!r} is not a token id (ASCII digits)")
        logit_bias[token_id] = bias  # the value's range and finiteness: SamplingParams.validate
    constraint = sp.WhichOneof("constraint")
    constraints = {_CONSTRAINT_FIELDS[constraint]: getattr(sp, constraint)} if constraint else {}
    return SamplingParams(
        **constraints,
        max_new_tokens=max_new_tokens,
        min_new_tokens=sp.min_new_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p or 1.0,
        top_k=sp.top_k or -1,
        min_p=sp.min_p,
        repetition_penalty=sp.repetition_penalty or 1.0,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        logit_bias=logit_bias,
        seed=seed,
        n=sp.n or 1,
        skip_special_tokens=sp.skip_special_tokens,
        no_stop_trim=sp.no_stop_trim,
    )


def _seed(sp: pb.SamplingParams) -> Optional[int]:
    """custom_params.seed (smg's convention: SamplingParams has no seed field), read from the Struct itself:
    json_format.MessageToDict raises a bare ValueError on NaN or Infinity, which would surface as UNKNOWN."""
    if not sp.HasField("custom_params"):
        return None
    fields = sp.custom_params.fields
    unknown = sorted(set(fields) - _CUSTOM_PARAMS)
    if unknown:
        _reject("sampling_params.custom_params", f"unknown key(s) {unknown}; supported: {sorted(_CUSTOM_PARAMS)}")
    kind = fields["seed"].WhichOneof("kind") if "seed" in fields else None
    if kind in (None, "null_value"):
        return None
    number = fields["seed"].number_value
    if kind != "number_value":
        _reject("seed", f"custom_params.seed must be an integer, got a {kind.removesuffix('_value')}")
    if not math.isfinite(number) or not number.is_integer():
        _reject("seed", f"custom_params.seed must be an integer, got {number!r}")
    return int(number)


def generate_request_from_proto(req: pb.GenerateRequest, rid: str, max_context_len: int) -> GenerateRequest:
    check_unsupported(req)
    input_ids = list(req.tokenized.input_ids)
    params = sampling_params_from_proto(req.sampling_params, len(input_ids), max_context_len)
    return GenerateRequest(
        rid=rid, input_ids=input_ids, sampling_params=params,
        return_logprob=req.return_logprob,
        top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
        logprob_start_len=req.logprob_start_len if req.return_logprob else -1,
        stream=req.stream,
        lora_id=req.lora_id or None,
        **disaggregated_fields(req),
    )


def disaggregated_fields(req: pb.GenerateRequest) -> dict:
    if not req.HasField("disaggregated_params"):
        return {}
    dp = req.disaggregated_params
    return {"bootstrap_host": dp.bootstrap_host, "bootstrap_port": dp.bootstrap_port,
            "bootstrap_room": dp.bootstrap_room}


# ---- outputs --------------------------------------------------------------------------------------


def output_logprobs(token_ids: list[int], logprobs: Optional[list[float]],
                    top_logprobs: Optional[list[list[tuple[int, float]]]]) -> Optional[pb.OutputLogProbs]:
    if not logprobs:
        return None
    msg = pb.OutputLogProbs(token_logprobs=logprobs, token_ids=token_ids[:len(logprobs)])
    for row in top_logprobs or []:
        msg.top_logprobs.add(token_ids=[t for t, _ in row], values=[v for _, v in row])
    return msg


def input_logprobs(input_ids: list[int], start: int, values: Optional[list[Optional[float]]],
                   tops: Optional[list[list[tuple[int, float]]]] = None) -> Optional[pb.InputLogProbs]:
    """SGLang's input_token_logprobs (no value for the first token) and input_top_logprobs (an empty row there)."""
    if values is None:
        return None
    msg = pb.InputLogProbs(token_ids=input_ids[start:start + len(values)])
    for value in values:
        entry = msg.token_logprobs.add()
        if value is not None:
            entry.value = value
    for row in tops or []:
        msg.top_logprobs.add(token_ids=[t for t, _ in row], values=[v for _, v in row])
    return msg


@dataclass
class SequenceState(SequenceResult):
    """A sequence of a streamed request (for the final GenerateComplete): its prompt logprobs go out once."""

    input_logprobs_sent: bool = False
    # Tokens sent in chunks so far: with --stream-interval some of output_ids may still be held back.
    streamed: int = 0


def stream_chunk(rid: str, req: GenerateRequest, out: TokenOutput, seq: SequenceState) -> pb.GenerateResponse:
    seq.streamed += len(out.token_ids)
    chunk = pb.GenerateStreamChunk(
        token_ids=out.token_ids, prompt_tokens=out.prompt_tokens, completion_tokens=seq.streamed,
        cached_tokens=out.cached_tokens, index=out.index)
    lps = output_logprobs(out.token_ids, out.logprobs, out.top_logprobs)
    if lps is not None:
        chunk.output_logprobs.CopyFrom(lps)
    if seq.input_logprobs is not None and not seq.input_logprobs_sent:
        seq.input_logprobs_sent = True
        chunk.input_logprobs.CopyFrom(input_logprobs(req.input_ids, max(req.logprob_start_len, 0),
                                                     seq.input_logprobs, seq.input_top_logprobs))
    return pb.GenerateResponse(request_id=rid, chunk=chunk)


def complete(rid: str, req: GenerateRequest, out: TokenOutput, seq: SequenceState) -> pb.GenerateResponse:
    reason = out.finish_reason
    done = pb.GenerateComplete(
        output_ids=seq.output_ids, finish_reason=reason.kind if reason else "stop",
        prompt_tokens=out.prompt_tokens, completion_tokens=len(seq.output_ids),
        cached_tokens=out.cached_tokens, index=out.index)
    if reason is not None and reason.matched is not None:
        done.matched_token_id = reason.matched
    lps = output_logprobs(seq.output_ids, seq.logprobs, seq.top_logprobs)
    if lps is not None:
        done.output_logprobs.CopyFrom(lps)
    if seq.input_logprobs is not None:
        done.input_logprobs.CopyFrom(input_logprobs(req.input_ids, max(req.logprob_start_len, 0),
                                                    seq.input_logprobs, seq.input_top_logprobs))
    return pb.GenerateResponse(request_id=rid, complete=done)
