"""OpenAI's API over the engine: requests checked field by field, the one mapping of their fields onto
`TreeDecoder.stream`'s keywords (`generate_options`), responses and stream chunks, errors in OpenAI's
shape (`{"error": {"message", "type", "param", "code"}}`).

A field the engine does not implement (`tools`, `response_format`, `logit_bias`, ...) is a 400 that
names it, never ignored; so is a field OpenAI does not define. `null` counts as absent, as in OpenAI's
API, and so does an empty value of an unimplemented field (`"tools": []`, `"logit_bias": {}`): it asks
for nothing. docs/server.md lists the fields and defaults.
Nothing here imports torch or touches a model: the tokenizer is passed in.
"""

from __future__ import annotations

import math
import numbers
import secrets
import time
from dataclasses import dataclass, field

from ..config import SEED_RANGE, SamplingConfig

MAX_N = 16                          # choices per request (generated one after another)
MAX_STOPS = 4                       # stop strings, as OpenAI allows
MAX_TOP_LOGPROBS = 20               # chat's top_logprobs
MAX_COMPLETION_LOGPROBS = 5         # completions' logprobs
# max_tokens when a request gives none: OpenAI's 16 for /v1/completions; for chat, 256 or the room the
# context window leaves after the prompt, whichever is less (OpenAI's "the room left" ran a small model
# on for thousands of tokens)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 1.0           # OpenAI's; 0 is greedy

# A chat message's fields: `name` (a participant's name) is accepted and not used, as chat templates
# leave it out.
MESSAGE_FIELDS = ("role", "content", "name")

# Fields OpenAI defines that the engine does not implement: named in a 400 (a null counts as absent).
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "logit_bias",
               "parallel_tool_calls", "audio", "modalities", "prediction", "reasoning_effort", "service_tier",
               "store", "metadata", "web_search_options", "verbosity", "prompt_cache_key", "safety_identifier")
_COMMON = ("model", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "stream", "stream_options",
           "frequency_penalty", "presence_penalty", "logprobs", "user")
CHAT_FIELDS = _COMMON + ("messages", "max_completion_tokens", "top_logprobs")
COMPLETION_FIELDS = _COMMON + ("prompt", "echo", "best_of", "suffix")
ROLES = ("system", "developer", "user", "assistant")

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "length": "length"}


class APIError(Exception):
    """An error answered in OpenAI's shape.

    Args:
        status: the HTTP status.
        message: what was wrong, for a person.
        type: OpenAI's error type ("invalid_request_error", "server_error", ...).
        param: the request field at fault, or None.
        code: a short machine-readable code, or None.
        headers: extra response headers (`Retry-After`, ...).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def payload(self) -> dict:
        return error_payload(self.message, self.type, self.param, self.code)


def error_payload(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 naming the field at fault."""
    return APIError(400, message, "invalid_request_error", param, code)


@dataclass
class Request:
    """One checked request; `prompts` is a list of message lists (chat: one) or of prompts (a string or
    token ids) for completions, each answered `n` times, one after another."""

    endpoint: str                                  # "chat" or "completion"
    model: str
    prompts: list
    max_tokens: int | None = None                  # None: the endpoint's default
    temperature: float = DEFAULT_TEMPERATURE       # OpenAI's default; 0 is greedy
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))


# ---------------------------------------------------------------------------------------------- checking

def parse(endpoint: str, body, model_ids: tuple[str, ...]) -> Request:
    """A request body (parsed JSON) -> Request; APIError naming the first field at fault.

    Args:
        endpoint: "chat" (/v1/chat/completions) or "completion" (/v1/completions).
        body: the parsed JSON.
        model_ids: the names this server answers to.
    """
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_json_type(body)}")
    allowed = CHAT_FIELDS if endpoint == "chat" else COMPLETION_FIELDS
    given = {k: v for k, v in body.items() if v is not None}
    unsupported = [k for k in given if k in UNSUPPORTED and given[k] not in ({}, [], "", False)]
    if unsupported:
        raise bad(f"unsupported field(s): {', '.join(sorted(unsupported))}; this server decodes plain text "
                  f"(supported: {', '.join(allowed)})", param=sorted(unsupported)[0], code="unsupported_parameter")
    unknown = sorted(k for k in given if k not in allowed and k not in UNSUPPORTED)
    if unknown:
        raise bad(f"unknown field(s): {', '.join(unknown)} (supported: {', '.join(allowed)})", param=unknown[0],
                  code="unknown_parameter")

    model = given.get("model")
    if model is None:
        raise bad("missing required field: model", param="model")
    _string(model, "model")
    if model not in model_ids:
        raise APIError(404, f"the model {model!r} does not exist on this server (it serves {model_ids[0]!r})",
                       param="model", code="model_not_found")
    req = Request(endpoint=endpoint, model=model, prompts=[])
    if endpoint == "chat":
        req.prompts = [_messages(given.get("messages"))]
    else:
        req.prompts = _completion_prompts(given.get("prompt"))

    max_tokens = given.get("max_completion_tokens", given.get("max_tokens"))
    if "max_completion_tokens" in given and "max_tokens" in given and given["max_tokens"] != max_tokens:
        raise bad("max_tokens and max_completion_tokens disagree; send one of them", param="max_tokens")
    if max_tokens is not None:
        req.max_tokens = _integer(max_tokens, "max_completion_tokens" if "max_completion_tokens" in given
                                  else "max_tokens", 1)
    req.temperature = _number(given.get("temperature", DEFAULT_TEMPERATURE), "temperature", 0.0, 2.0)
    req.top_p = _number(given.get("top_p", 1.0), "top_p", 0.0, 1.0, low_open=True)
    req.n = _integer(given.get("n", 1), "n", 1, MAX_N)
    if "seed" in given:
        req.seed = _integer(given["seed"], "seed", *SEED_RANGE)
    req.stop = _stops(given.get("stop"))
    req.stream = _boolean(given.get("stream", False), "stream")
    options = given.get("stream_options")
    if options is not None:
        if not req.stream:
            raise bad("stream_options is only allowed with stream: true", param="stream_options")
        if not isinstance(options, dict):
            raise bad(f"stream_options must be an object, got {_json_type(options)}", param="stream_options")
        extra = sorted(set(options) - {"include_usage"})
        if extra:
            raise bad(f"unsupported stream_options field(s): {', '.join(extra)} (supported: include_usage)",
                      param="stream_options")
        req.include_usage = _boolean(options.get("include_usage", False), "stream_options.include_usage")
    req.frequency_penalty = _number(given.get("frequency_penalty", 0.0), "frequency_penalty", -2.0, 2.0)
    req.presence_penalty = _number(given.get("presence_penalty", 0.0), "presence_penalty", -2.0, 2.0)
    if "user" in given:
        _string(given["user"], "user")
    if endpoint == "chat":
        req.logprobs = _boolean(given.get("logprobs", False), "logprobs")
        if "top_logprobs" in given:
            req.top_logprobs = _integer(given["top_logprobs"], "top_logprobs", 0, MAX_TOP_LOGPROBS)
            if not req.logprobs:
                raise bad("top_logprobs needs logprobs: true", param="top_logprobs")
    else:
        if "logprobs" in given:                     # completions: how many alternatives, the chosen token always
            req.logprobs = True
            req.top_logprobs = _integer(given["logprobs"], "logprobs", 0, MAX_COMPLETION_LOGPROBS)
        if _boolean(given.get("echo", False), "echo"):
            raise bad("echo is not supported: the answer holds the completion only", param="echo",
                      code="unsupported_parameter")
        if "best_of" in given and _integer(given["best_of"], "best_of", 1, MAX_N) != req.n:
            raise bad("best_of is not supported (the engine returns every choice it generates); leave it out or "
                      "set it equal to n", param="best_of", code="unsupported_parameter")
        if given.get("suffix") not in (None, ""):
            raise bad("suffix is not supported (no fill-in-the-middle)", param="suffix", code="unsupported_parameter")
    return req


def _messages(messages) -> list[dict]:
    """OpenAI chat messages -> [{"role", "content"}] with text content; text parts are joined."""
    if messages is None:
        raise bad("missing required field: messages", param="messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty array of {role, content} objects", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(f"{where} must be an object, got {_json_type(message)}", param=where)
        extra = sorted(k for k, v in message.items() if k not in MESSAGE_FIELDS and v is not None)
        if extra:
            raise bad(f"{where}: unsupported field(s) {', '.join(extra)} (messages take role, text content and "
                      f"name)", param=f"{where}.{extra[0]}", code="unsupported_parameter")
        if message.get("name") is not None:         # a participant's name: OpenAI's, accepted and not used
            _string(message["name"], f"{where}.name")
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
        content = message.get("content")
        if isinstance(content, list):               # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else _json_type(part)
                    raise bad(f"{where}.content[{j}]: only text parts are supported, got {kind!r}",
                              param=f"{where}.content")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string or an array of text parts, got {_json_type(content)}",
                      param=f"{where}.content")
        _unicode(content, f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _completion_prompts(prompt) -> list:
    """A string, a list of strings, a list of token ids or a list of such lists -> a list of prompts."""
    if prompt is None:
        raise bad("missing required field: prompt", param="prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or (isinstance(p, list) and p and
                                                                           all(_is_int(t) for t in p))
                                                     for p in prompt):
        prompts = list(prompt)
    else:
        raise bad("prompt must be a string, an array of strings, an array of token ids or an array of such "
                  "arrays", param="prompt")
    if len(prompts) > MAX_N:
        raise bad(f"at most {MAX_N} prompts a request, got {len(prompts)}", param="prompt")
    for p in prompts:
        if isinstance(p, str):
            if not p.strip():
                raise bad("the prompt is empty", param="prompt")
            _unicode(p, "prompt")
    return prompts


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop must be a string or an array of strings", param="stop")
    if len(stops) > MAX_STOPS:
        raise bad(f"at most {MAX_STOPS} stop strings, got {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise bad("stop strings must not be empty", param="stop")
    for s in stops:
        _unicode(s, "stop")
    return tuple(stops)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(value, name: str, low: int, high: int | None = None) -> int:
    if not _is_int(value):
        raise bad(f"{name} must be an integer, got {_json_type(value)} {_short(value)}", param=name)
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise bad(f"{name} must be {bounds}, got {value}", param=name)
    return value


def _number(value, name: str, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise bad(f"{name} must be a number, got {_json_type(value)} {_short(value)}", param=name)
    value = float(value)
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise bad(f"{name} must be in {interval}, got {value:g}", param=name)
    return value


def _boolean(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise bad(f"{name} must be true or false, got {_json_type(value)} {_short(value)}", param=name)
    return value


def _string(value, name: str) -> str:
    if not isinstance(value, str):
        raise bad(f"{name} must be a string, got {_json_type(value)}", param=name)
    return value


def _unicode(text: str, name: str) -> None:
    """JSON's \\ud800-style escapes can carry lone surrogates, which are not text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad(f"{name} is not valid Unicode: a lone surrogate at character {exc.start}", param=name) from None


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else type(value).__name__


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------------------------------------- mapping

def generate_options(req: Request, prompt_len: int, choice: int, context_window: int | None) -> dict:
    """The one place where a request's fields become `TreeDecoder.stream` keywords.

    Args:
        req: the checked request.
        prompt_len: the prompt's tokens (for the context window and the penalties).
        choice: which of the `n` choices (a seed moves on by one per choice, so they differ).
        context_window: the target's, or None.
    Returns:
        keywords for `TreeDecoder.stream`; `logits_processor` holds the penalties and, with logprobs, a
        `TokenLogprobs` recorder (last) that a stream reads round by round.
    Raises:
        APIError (400) when the prompt, or the prompt with max_tokens, does not fit the context window.
    """
    from .processors import Penalties, TokenLogprobs

    param = "messages" if req.endpoint == "chat" else "prompt"
    if context_window is not None and prompt_len >= context_window:
        raise bad(f"the prompt is {prompt_len} tokens; the model's context window is {context_window} tokens, "
                  f"with room for the answer", param=param, code="context_length_exceeded")
    room = context_window - prompt_len if context_window is not None else None
    if req.max_tokens is not None:
        max_new = req.max_tokens
        if room is not None and max_new > room:
            raise bad(f"the prompt ({prompt_len} tokens) plus max_tokens ({max_new}) exceeds the model's context "
                      f"window of {context_window} tokens", param="max_tokens", code="context_length_exceeded")
    else:
        default = COMPLETIONS_DEFAULT_MAX_TOKENS if req.endpoint == "completion" else CHAT_DEFAULT_MAX_TOKENS
        max_new = min(default, room or default)
    processors = []
    if req.frequency_penalty or req.presence_penalty:
        processors.append(Penalties(prompt_len, req.frequency_penalty, req.presence_penalty))
    greedy = req.temperature == 0.0
    if req.logprobs:
        sampling = SamplingConfig(temperature=req.temperature, top_p=req.top_p) if not greedy else SamplingConfig()
        processors.append(TokenLogprobs(prompt_len, sampling, req.top_logprobs))
    options = dict(max_new_tokens=max_new, temperature=req.temperature, top_p=req.top_p,
                   seed=None if req.seed is None else _seed(req.seed + choice), stop_strings=req.stop,
                   return_logprobs=req.logprobs)
    if processors:
        options["logits_processor"] = processors
    return options


def _seed(seed: int) -> int:
    low, high = SEED_RANGE
    return seed if seed <= high else low + (seed - high - 1)      # choice k of a seed at the top wraps round


def recorder(options: dict):
    """The `TokenLogprobs` in a request's options, or None."""
    from .processors import TokenLogprobs
    return next((p for p in options.get("logits_processor", ()) if isinstance(p, TokenLogprobs)), None)


def chat_prompt(messages: list[dict], tokenizer) -> str:
    """The messages through the model's chat template, ready for the assistant's turn (as
    `mcsd-generate --chat` formats its prompt)."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad("the model's tokenizer has no chat template; use /v1/completions with a plain prompt",
                  param="messages", code="no_chat_template")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:                        # the template's own checks (roles out of order, ...)
        raise bad(f"the model's chat template refused these messages: {exc}", param="messages") from None


# ---------------------------------------------------------------------------------------------- answers

def cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """The text before the first stop string (OpenAI leaves the stop string out)."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(cuts)] if cuts else text


class TextStream:
    """The text of a growing list of tokens, in pieces that are safe to send: an incomplete UTF-8
    character (decoded as U+FFFD) and any tail that may be the start of a stop string are held back;
    the text ends before the first stop string.

    Args:
        tokenizer: decodes the tokens (special tokens skipped, as the final text is).
        stops: the request's stop strings.
    """

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.sent = ""

    def push(self, new_tokens: list[int]) -> str:
        """Add a round's tokens; returns the text that can be sent now."""
        self.tokens.extend(new_tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        ready = cut_at_stop(text, self.stops)
        if len(ready) == len(text):                  # no stop string yet: hold back what may become one
            ready = ready.rstrip("\ufffd")
            ready = ready[:len(ready) - self._stop_prefix(ready)]
        return self._advance(ready)

    def finish(self, final_text: str) -> str:
        """The rest of the answer, given its final text (which starts with what was sent)."""
        return self._advance(final_text)

    def _advance(self, ready: str) -> str:
        if len(ready) <= len(self.sent) or not ready.startswith(self.sent):
            return ""
        delta, self.sent = ready[len(self.sent):], ready
        return delta

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest


def token_logprobs(endpoint: str, tokenizer, tokens: list[int], rows: list, offset: int = 0) -> dict:
    """OpenAI's `logprobs` object for `tokens`.

    Args:
        endpoint: "chat" ({"content": [{token, logprob, bytes, top_logprobs}]}) or "completion"
            ({tokens, token_logprobs, top_logprobs, text_offset}).
        tokens: the token ids.
        rows: per token (log-probability, [(alternative token, log-probability)]).
        offset: completions: the text offset of the first token.
    """
    def text(t):
        return tokenizer.decode([t])

    if endpoint == "chat":
        def entry(t, lp):                           # each token decoded once
            s = text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alts]}
                            for t, (lp, alts) in zip(tokens, rows)]}
    strings, offsets = [text(t) for t in tokens], []
    for s in strings:
        offsets.append(offset)
        offset += len(s)
    has_top = any(alts for _, alts in rows)
    return {"tokens": strings, "token_logprobs": [lp for lp, _ in rows],
            "top_logprobs": [{text(a): alp for a, alp in alts} for _, alts in rows] if has_top else None,
            "text_offset": offsets}


def speculation(stats_list: list) -> dict:
    """The `mcsd` extra field: what speculation did for these generations (clients ignore it).
    tau is tokens per target forward; acceptance by depth d is P(depth d accepted | depth d-1 was);
    what drafted: `drafted_nodes` (the model drafter's: feature head or draft model) and
    `context_nodes` (context drafting's), summed over the rounds' trees; decoded in a batch,
    `batch_share` is their rows over all rows of the forwards they ran in, `batch_size` those
    forwards' slots on average, and `batch_exact` whether each answer is guaranteed the one a lone
    request gets (bit for bit on native q4 layers; false on dense, bfloat16 or torch's int4 kernel,
    where it is not promised)."""
    new = sum(s.new_tokens for s in stats_list)
    forwards = sum(s.target_forwards for s in stats_list)
    wall = sum(s.wall_s for s in stats_list)
    depth = max((len(s.offered_by_depth) for s in stats_list), default=0)
    offered = [sum(s.offered_by_depth[d] for s in stats_list if d < len(s.offered_by_depth)) for d in range(depth)]
    accepted = [sum(s.accepted_by_depth[d] for s in stats_list if d < len(s.accepted_by_depth)) for d in range(depth)]
    out = {"tau": round(new / forwards, 4) if forwards else 0.0,
           "accept_by_depth": [round(a / o, 4) if o else 0.0 for a, o in zip(accepted, offered)],
           "target_forwards": forwards, "draft_forwards": sum(s.draft_forwards for s in stats_list),
           "rounds": sum(s.rounds for s in stats_list), "tokens_per_s": round(new / wall, 2) if wall else 0.0,
           "wall_s": round(wall, 4),
           "drafted_nodes": sum(s.tree_nodes - s.context_nodes for s in stats_list),
           "context_nodes": sum(s.context_nodes for s in stats_list)}
    from ..core.output import GenerationStats
    batch = GenerationStats(**{k: sum(getattr(s, k) for s in stats_list)
                               for k in ("batch_rounds", "batch_rows", "batch_all_rows", "batch_slots")})
    if batch.batch_rounds:            # decoded in a batch: its share of those forwards, and their slots
        out["batch_share"], out["batch_size"] = round(batch.batch_share, 4), round(batch.batch_size, 3)
        out["batch_exact"] = all(s.batch_exact is not False for s in stats_list)
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(req: Request, choices: list[dict], prompt_tokens: int, completion_tokens: int, stats_list: list) -> dict:
    """The whole answer of a request that did not stream.

    Args:
        choices: per choice {"index", "text", "finish_reason", "logprobs" (an OpenAI logprobs object or None)}.
    """
    if req.endpoint == "chat":
        body_choices = [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                         "logprobs": c["logprobs"], "finish_reason": c["finish_reason"]} for c in choices]
        kind = "chat.completion"
    else:
        body_choices = [{"index": c["index"], "text": c["text"], "logprobs": c["logprobs"],
                         "finish_reason": c["finish_reason"]} for c in choices]
        kind = "text_completion"
    return {"id": response_id(req), "object": kind, "created": req.created, "model": req.model,
            "choices": body_choices, "usage": usage(prompt_tokens, completion_tokens),
            "system_fingerprint": None, "mcsd": speculation(stats_list)}


def response_id(req: Request) -> str:
    return f"{'chatcmpl' if req.endpoint == 'chat' else 'cmpl'}-{req.id}"


def chunk(req: Request, index: int, text: str | None = None, logprobs: dict | None = None,
          finish_reason: str | None = None, role: bool = False, stats: dict | None = None) -> dict:
    """One streamed chunk for choice `index`: a piece of text (with its tokens' logprobs), the
    assistant's role (chat's first chunk), or the finish reason (with the choice's `mcsd` figures)."""
    if req.endpoint == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        kind = "text_completion"
    out = {"id": response_id(req), "object": kind, "created": req.created, "model": req.model,
           "choices": [choice], "system_fingerprint": None}
    if req.include_usage:
        out["usage"] = None
    if stats is not None:
        out["mcsd"] = stats
    return out


def usage_chunk(req: Request, prompt_tokens: int, completion_tokens: int) -> dict:
    """The last chunk with `stream_options.include_usage`: no choices, the request's usage."""
    return {"id": response_id(req), "object": "chat.completion.chunk" if req.endpoint == "chat" else "text_completion",
            "created": req.created, "model": req.model, "choices": [], "system_fingerprint": None,
            "usage": usage(prompt_tokens, completion_tokens)}
