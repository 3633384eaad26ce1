"""SamplingParams: one request's decoding knobs (SGLang semantics and defaults), with validation."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from tandem.common.errors import InvalidRequestError

# Most alternatives per position a request may ask logprobs for (OpenAI's limit, shared by engine and router).
MAX_TOP_LOGPROBS = 20

MAX_N = 128
MAX_SEED = 2**63
LOGIT_BIAS_LIMIT = 100.0
PENALTY_LIMIT = 2.0

_INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "no_stop_trim")
# Constrained decoding (SGLang's names): at most one per request; compiled by common/sampling/grammar.py.
CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


@dataclass
class SamplingParams:
    """Per-request sampling parameters. `temperature == 0` means greedy; `top_k` of -1 (or 0) means off.

    `stop` strings are matched by the detokenizing layer; here they are only validated and carried.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: Optional[int] = None
    n: int = 1
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    json_schema: Optional[str] = None  # a JSON schema (text), or "$$ANY$$" for any JSON value
    regex: Optional[str] = None
    ebnf: Optional[str] = None  # a GBNF grammar whose start rule is `root`
    structural_tag: Optional[str] = None  # JSON text of an xgrammar/SGLang structural tag

    def __post_init__(self) -> None:
        if self.top_k == 0:
            self.top_k = -1  # SGLang and OpenAI clients use both spellings for "off"
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.stop is None:
            self.stop = []
        if self.logit_bias is None:
            self.logit_bias = {}

    # ---- derived properties ----------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def constraint(self) -> Optional[tuple[str, str]]:
        """(field, text) of the request's constraint, or None."""
        for name in CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    # ---- validation ------------------------------------------------------------------------

    def validate(self, vocab_size: int, max_new_tokens_limit: Optional[int] = None) -> None:
        """Raise InvalidRequestError naming the first invalid field and its allowed range."""
        for name in _FLOAT_FIELDS:
            _require_number(name, getattr(self, name))
        for name in _INT_FIELDS:
            _require_int(name, getattr(self, name))
        _check(self.temperature >= 0.0, "temperature", f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(-PENALTY_LIMIT <= value <= PENALTY_LIMIT, name,
                   f"{name} must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {value}")
        self._validate_lengths(max_new_tokens_limit)
        self._validate_token_ids(vocab_size)
        _check(1 <= self.n <= MAX_N, "n", f"n must be in [1, {MAX_N}], got {self.n}")
        if self.seed is not None:
            _require_int("seed", self.seed)
            _check(0 <= self.seed < MAX_SEED, "seed", f"seed must be in [0, 2**63), got {self.seed}")
        _check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop), "stop",
               "stop must be a list of non-empty strings")
        for name in _BOOL_FIELDS:
            _check(isinstance(getattr(self, name), bool), name, f"{name} must be a boolean")
        self._validate_constraint()

    def _validate_constraint(self) -> None:
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        _check(len(given) <= 1, given[-1] if given else "constraint",
               f"at most one of {', '.join(CONSTRAINT_FIELDS)} may be set, got {', '.join(given)}")
        for name in given:
            value = getattr(self, name)
            _check(isinstance(value, str) and value.strip() != "", name, f"{name} must be a non-empty string")

    def _validate_lengths(self, max_new_tokens_limit: Optional[int]) -> None:
        _check(self.max_new_tokens >= 0, "max_new_tokens", f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if max_new_tokens_limit is not None:
            _check(self.max_new_tokens <= max_new_tokens_limit, "max_new_tokens",
                   f"max_new_tokens must be in [0, {max_new_tokens_limit}], got {self.max_new_tokens}")
        _check(0 <= self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
               f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}")

    def _validate_token_ids(self, vocab_size: int) -> None:
        _check(isinstance(self.stop_token_ids, list), "stop_token_ids", "stop_token_ids must be a list of ints")
        for tok in self.stop_token_ids:
            _check(_is_int(tok) and 0 <= tok < vocab_size, "stop_token_ids",
                   f"stop_token_ids entries must be ints in [0, {vocab_size}), got {tok!r}")
        _check(isinstance(self.logit_bias, dict), "logit_bias", "logit_bias must be a mapping token id -> bias")
        for tok, bias in self.logit_bias.items():
            _check(_is_int(tok) and 0 <= tok < vocab_size, "logit_bias",
                   f"logit_bias keys must be token ids in [0, {vocab_size}), got {tok!r}")
            _check(_is_number(bias) and -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT, "logit_bias",
                   f"logit_bias values must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {bias!r}")

    # ---- (de)serialisation -----------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from a JSON-style dict; unknown keys and wrong types raise InvalidRequestError.

        A value of None means "use the default". logit_bias keys may be strings (JSON object keys).
        """
        if not isinstance(d, dict):
            raise InvalidRequestError("sampling_params must be an object", "sampling_params")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling parameter(s) {unknown}; allowed: {sorted(known)}", str(unknown[0]))
        kwargs: dict[str, Any] = {}
        for name, value in d.items():
            if value is None and name != "seed":
                continue
            kwargs[name] = _coerce(name, value)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["logit_bias"] = dict(self.logit_bias)
        return out


# ---- helpers ---------------------------------------------------------------------------------


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message, name)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite int or float: NaN and ±Infinity compare false against every range, so they are refused here."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and not (isinstance(value, float) and not math.isfinite(value)))


def token_id_key(key: str) -> Optional[int]:
    """A logit_bias key (a JSON object key) as a token id, or None unless it is ASCII decimal digits only.

    str.isdigit() alone accepts "²" (which int() then refuses) and "١" (which int() reads as 1); signs and
    spaces are not part of a token id either. The length bound keeps int() cheap."""
    if not (key.isascii() and key.isdigit() and len(key) <= 18):
        return None
    return int(key)


def _require_int(name: str, value: Any) -> None:
    _check(_is_int(value), name, f"{name} must be an integer, got {value!r}")


def _require_number(name: str, value: Any) -> None:
    _check(_is_number(value), name, f"{name} must be a finite number, got {value!r}")


def _coerce(name: str, value: Any) -> Any:
    """Type-check one from_dict value, converting only lossless JSON spellings (int -> float, "7" keys)."""
    if name in _INT_FIELDS or name == "seed":
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        _require_int(name, value)
        return value
    if name in _FLOAT_FIELDS:
        _require_number(name, value)
        return float(value)
    if name in _BOOL_FIELDS:
        _check(isinstance(value, bool), name, f"{name} must be a boolean, got {value!r}")
        return value
    if name == "stop":
        if isinstance(value, str):
            value = [value]
        _check(isinstance(value, list) and all(isinstance(s, str) for s in value), name,
               "stop must be a string or a list of strings")
        return list(value)
    if name == "stop_token_ids":
        _check(isinstance(value, list) and all(_is_int(t) for t in value), name,
               "stop_token_ids must be a list of integers")
        return list(value)
    if name == "logit_bias":
        return _coerce_logit_bias(value)
    if name in CONSTRAINT_FIELDS:
        if name in ("json_schema", "structural_tag") and isinstance(value, dict):
            value = json.dumps(value)  # a JSONL line may carry the schema as an object
        _check(isinstance(value, str), name, f"{name} must be a string, got {type(value).__name__}")
        return value
    raise AssertionError(f"no coercion rule for {name}")


def _coerce_logit_bias(value: Any) -> dict[int, float]:
    _check(isinstance(value, dict), "logit_bias", "logit_bias must be an object mapping token id -> bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, str):
            token_id = token_id_key(key)
            _check(token_id is not None, "logit_bias", f"logit_bias key {key!r} is not a token id (ASCII digits)")
            key = token_id
        _check(_is_int(key), "logit_bias", f"logit_bias key {key!r} is not a token id")
        _check(_is_number(bias), "logit_bias", f"logit_bias value for {key} must be a finite number, got {bias!r}")
        out[key] = float(bias)
    return out
