"""What crosses the API ↔ worker boundary (a Ray actor call): plain dataclasses with explicit
`to_dict` / `from_dict` (JSON-able values only, never pickled objects of ours).

One completion request (one choice: the API fans `n > 1` out into n requests with seed streams
0..n−1) goes to a worker, which answers with a stream of `Chunk`s: new tokens and text as they are
committed, and a last chunk with `finish_reason` and `usage`. An error is a chunk with `error` set
(before any token: the API answers with its HTTP status; after: it is sent in-band).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from specloop.drafter.decode.grammar import GrammarSpec
from specloop.drafter.decode.requests import EngineRequest
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.decode.shaping import Controls


class ProtocolError(ValueError):
    """A message that does not have the shape of its dataclass."""


def _from_dict(cls, data: dict):
    if not isinstance(data, dict):
        raise ProtocolError(f"{cls.__name__}: expected a dict, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ProtocolError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ProtocolError(f"{cls.__name__}: {exc}") from None


@dataclass
class CompletionRequest:
    id: str
    prompt_ids: list[int]
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stream_index: int = 0  # the request draws from the stream seeded by (seed, stream_index), as
    #                        request `stream_index` of `specloop generate --seed seed` does
    stop: list[str] = field(default_factory=list)
    k: int | None = None  # draft length; None = auto (the worker's controller, step by step); 0 = speculation off
    drafter_version: str | None = None  # None = the serving champion
    # None: no log-probabilities; n (0..20): each token's, with its n most likely alternatives
    logprobs: int | None = None
    # None: the prompt's tokens are not scored; n (0..20): each prompt token after the first, with n alternatives, in
    # the first chunk (OpenAI's `echo` with `logprobs`); with max_tokens 0 the request only scores its prompt
    prompt_logprobs: int | None = None
    ignore_eos: bool = False  # EOS does not end the request (vLLM's; benchmarks use it for fixed lengths)
    # the usual sampling controls (vLLM's semantics; specloop.drafter.decode.shaping applies them losslessly)
    presence_penalty: float = 0.0  # subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and output tokens
    min_p: float = 0.0  # drop tokens whose probability is below min_p × the top token's
    logit_bias: list[tuple[int, float]] = field(default_factory=list)  # (token id, bias added to its logit)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    stop_token_ids: list[int] = field(default_factory=list)  # tokens that end the request like EOS (not emitted)
    # structured output: {"kind": "json_schema" | "json_object" | "regex" | "choice" | "lark", "spec": str}
    # (json_schema: the schema as JSON text; choice: a JSON list of strings; lark: llguidance's Lark grammar)
    guided: dict | None = None

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.max_tokens, tuple(self.stop), self.seed,
                              self.ignore_eos, self.min_p, tuple(self.stop_token_ids))

    def controls(self) -> Controls:
        return Controls(self.presence_penalty, self.frequency_penalty, self.repetition_penalty,
                        tuple((int(t), float(b)) for t, b in self.logit_bias), self.min_tokens)

    def engine_request(self) -> EngineRequest:
        """The request as the engine takes it (drafter/decode/requests.py)."""
        return EngineRequest(self.id, list(self.prompt_ids), self.sampling(), self.k, self.stream_index, self.logprobs,
                             self.controls(), GrammarSpec.from_dict(self.guided))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CompletionRequest":
        req = _from_dict(cls, data)
        req.stop = list(req.stop)
        req.logit_bias = [(int(t), float(b)) for t, b in req.logit_bias]
        req.stop_token_ids = list(req.stop_token_ids)
        return req


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    blocks: int = 0
    drafter_version: str | None = None  # the version(s) that drafted, comma-joined when it changed
    queue_time_s: float = 0.0  # how long the request waited in the worker's queue for a cache slot


@dataclass
class ErrorInfo:
    message: str
    type: str  # OpenAI error type: invalid_request_error | not_found_error | server_error | overloaded_error
    status: int  # the HTTP status the API answers with
    param: str | None = None
    code: str | None = None


MAX_TOP_LOGPROBS = 20


@dataclass
class TokenLogprob:
    """One emitted token's log-probability under the verifier's distribution as served (its raw
    logits, before temperature / top-k / top-p, as vLLM reports them), and the `top` most likely
    tokens at that position: (token id, log-probability) pairs, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict) -> "TokenLogprob":
        entry = _from_dict(cls, data)
        entry.top = [(int(t), float(lp)) for t, lp in entry.top]
        return entry


@dataclass
class Chunk:
    id: str
    token_ids: list[int] = field(default_factory=list)  # tokens committed since the last chunk
    text: str = ""  # their text (incremental detokenization; a stop string and what follows are cut)
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last chunk
    usage: Usage | None = None  # on the last chunk
    error: ErrorInfo | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's tokens after the first (a request's first chunk)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Chunk":
        chunk = _from_dict(cls, data)
        for name in ("logprobs", "prompt_logprobs"):
            entries = getattr(chunk, name)
            if entries is not None:
                setattr(chunk, name, [e if isinstance(e, TokenLogprob) else TokenLogprob.from_dict(e) for e in entries])
        if isinstance(chunk.usage, dict):
            chunk.usage = _from_dict(Usage, chunk.usage)
        if isinstance(chunk.error, dict):
            chunk.error = _from_dict(ErrorInfo, chunk.error)
        return chunk

    @property
    def last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


def overloaded(request_id: str, retry_after_s: int = 1) -> Chunk:
    msg = f"the server is overloaded; retry after {retry_after_s} s"
    return Chunk(request_id, error=ErrorInfo(msg, "overloaded_error", 503, code="overloaded"))


def invalid(request_id: str, message: str, param: str | None = None) -> Chunk:
    return Chunk(request_id, error=ErrorInfo(message, "invalid_request_error", 400, param=param))


@dataclass
class WorkerInfo:
    """What a worker says about itself (`describe`): the API needs it to validate and route."""

    name: str
    verifier: str  # verifier directory (the API loads its tokenizer from it)
    model: str  # the model id clients name
    drafter_kind: str
    drafter_version: str
    # positions per slot: prompt + max_tokens + 2 k + 2 must fit (k drafts + bonus, twice for rollback room)
    max_context: int
    slots: int
    max_queue: int
    registry: str | None = None  # registry folder (operator endpoints)
    redis_url: str | None = None  # registry metadata / buffer in Redis
    prefix: str = "specloop"
    buffer: str | None = None  # buffer spec ("memory" or a redis URL), None = no logging
    metrics_url: str | None = None  # host:port of its Prometheus endpoint
    # the verifier as served (specloop.drafter.model.weights.quant.describe_mode): "fp32",
    # "w4a8 (int4 weights, int8 activations, specloop kernels)"
    weights: str = "fp32"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "WorkerInfo":
        return _from_dict(cls, data)


@dataclass
class WorkerLoad:
    queued: int
    running: int
    slots: int
    max_queue: int
    version: str

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "WorkerLoad":
        return _from_dict(cls, data)
