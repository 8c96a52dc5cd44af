"""Frozen configuration dataclasses: what to generate and how the tree is shaped.

Config is data. The CLI maps flags onto these by keyword; nothing in the engine
reads globals or keys behaviour on a model's name.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A user-supplied setting is invalid. The message says which one and why."""


# Names the settings accept, spelled here without torch so the command line can
# offer them before anything heavy is imported.
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}          # accepted name -> torch dtype name
ATTENTION_BACKENDS = ("auto", "sdpa", "gqa", "xformers", "eager")
SAMPLING_METHODS = ("gumbel", "rejection")   # mcsd.core.sampling's two ways to draw
WEIGHTS = ("dense", "q4", "q4q8")         # how a target's linear layers run (mcsd.drafting.pair.load_model)


def check_context_window(context_window: int | None, prompt_len: int, max_new_tokens: int) -> None:
    """A ConfigError when the prompt and the tokens asked for do not fit the target's context window."""
    if context_window is not None and prompt_len + max_new_tokens > context_window:
        raise ConfigError(f"prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
                          f"target's context window of {context_window} tokens")


def _shown(value) -> str:
    """A value as an error message names it: its type, and its repr where that is short."""
    text = repr(value)
    return f"{type(value).__name__} {text}" if len(text) <= 40 else type(value).__name__


def check_callback(name: str, value, called_with: str) -> None:
    """A ConfigError naming the argument `name` when `value` is neither None nor callable."""
    if value is not None and not callable(value):
        raise ConfigError(f"{name} must be a function (called with {called_with}) or None, got {_shown(value)}")


def check_tokenizer(tokenizer) -> None:
    """A ConfigError naming the argument when `tokenizer` is neither None nor a tokenizer (callable on
    text, with `decode`)."""
    if tokenizer is not None and not (callable(tokenizer) and callable(getattr(tokenizer, "decode", None))):
        raise ConfigError(f"tokenizer must be a tokenizer (transformers' AutoTokenizer.from_pretrained(...); "
                          f"mcsd.load_model_pair returns the pair's) or None, got {_shown(tokenizer)}")


def check_lossy_roots(width: int, sampling: "SamplingConfig", prompt_len: int | None = None,
                      reads_features: bool = False, name: str = "lossy_target_roots") -> None:
    """A ConfigError when lossy target roots (width > 0) are asked for with sampling: the variant is
    defined for greedy decoding only; or, where the prompt's length (`prompt_len` tokens) is known, for
    a one-token prompt with a drafter that reads the target's features (`reads_features`): the first
    round's root is then the prompt's only token, and such a drafter reads the feature of the position
    before the root, which a one-token prompt does not have. `name`: the setting as the caller spells it."""
    if width and not sampling.greedy:
        raise ConfigError(f"{name} is defined for greedy decoding only (temperature 0)")
    if width and reads_features and prompt_len is not None and prompt_len < 2:
        raise ConfigError(f"{name} with a drafter that reads the target's features (a feature head) "
                          f"needs a prompt of 2 tokens or more, got {prompt_len}: the first round's root is the "
                          f"prompt's last token, and the head reads the target's features before it")


def _number(name: str, value) -> float:
    """A real number (not a bool, not a string); ConfigError otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    return float(value)


def _integer(name: str, value, low: int, high: int | None = None) -> int:
    """An integer in [low, high] (a float holding a whole number counts); ConfigError otherwise."""
    whole = isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole:
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise ConfigError(f"{name} must be an integer {bounds}, got {value}")
    return int(value)


# torch.Generator.manual_seed takes any 64-bit value, signed or unsigned.
SEED_RANGE = (-2**63, 2**64 - 1)


@dataclass(frozen=True)
class SamplingConfig:
    """How a next token is chosen from logits. Applied identically to target and draft."""

    temperature: float = 0.0  # 0 means greedy (argmax); > 0 samples from softmax(logits / T)
    top_k: int = 0            # keep only the k most likely tokens; 0 disables
    top_p: float = 1.0        # keep the smallest set of tokens whose mass reaches top_p; 1.0 disables
    min_p: float = 0.0        # drop tokens below min_p x the top token's probability; 0 disables
    typical_p: float = 1.0    # locally typical sampling: keep the most typical tokens up to this mass; 1.0 disables
    method: str = "gumbel"    # how tokens are drawn: "gumbel" (noise keyed by seed and position; a seed
                              # repeats whatever the drafts) or "rejection" (multi-candidate rejection sampling)

    def __post_init__(self):
        temperature, top_p = _number("temperature", self.temperature), _number("top_p", self.top_p)
        min_p, typical_p = _number("min_p", self.min_p), _number("typical_p", self.typical_p)
        if not (0.0 <= temperature < math.inf):
            raise ConfigError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not (0.0 < top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= min_p <= 1.0):
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (0.0 < typical_p <= 1.0):
            raise ConfigError(f"typical_p must be in (0, 1], got {self.typical_p}")
        object.__setattr__(self, "min_p", min_p)
        object.__setattr__(self, "typical_p", typical_p)
        # frozen: stored once here as plain Python numbers
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_k", _integer("top_k", self.top_k, 0))
        object.__setattr__(self, "top_p", top_p)
        if self.method not in SAMPLING_METHODS:
            raise ConfigError(f"sampling method must be one of {', '.join(SAMPLING_METHODS)}, got {self.method!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class ProcessingConfig:
    """Logits processors applied at every tree node before a token is chosen (`mcsd.core.processors`).

    The options mirror `model.generate`'s of the same names; they are applied
    in Hugging Face's order (repetition penalty, n-gram ban, bad words, minimum
    lengths, suppressed tokens), then the caller's own `logits_processor` list,
    then the sampling warpers of `SamplingConfig`.
    """

    repetition_penalty: float = 1.0                # > 1 penalises tokens already in the sequence; 1 disables
    no_repeat_ngram_size: int = 0                  # ban any n-gram from occurring twice; 0 disables
    bad_words_ids: tuple[tuple[int, ...], ...] = ()   # token sequences never to generate
    min_length: int = 0                            # no EOS before the sequence (prompt included) is this long
    min_new_tokens: int = 0                        # no EOS before this many new tokens
    suppress_tokens: tuple[int, ...] = ()          # tokens never generated
    logits_processor: tuple = ()                   # the caller's LogitsProcessor objects, in order

    def __post_init__(self):
        penalty = _number("repetition_penalty", self.repetition_penalty)
        if not (0.0 < penalty < math.inf):
            raise ConfigError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        object.__setattr__(self, "repetition_penalty", penalty)
        for name in ("no_repeat_ngram_size", "min_length", "min_new_tokens"):
            object.__setattr__(self, name, _integer(name, getattr(self, name), 0))
        try:
            bad = tuple(tuple(_integer("bad_words_ids", t, 0) for t in seq) for seq in (self.bad_words_ids or ()))
        except TypeError:
            raise ConfigError(f"bad_words_ids must be a list of lists of token ids, got {self.bad_words_ids!r}") \
                from None
        if any(not seq for seq in bad):
            raise ConfigError("bad_words_ids must not hold an empty sequence")
        object.__setattr__(self, "bad_words_ids", bad)
        object.__setattr__(self, "suppress_tokens", tuple(_integer("suppress_tokens", t, 0)
                                                          for t in _as_tuple(self.suppress_tokens, numbers.Integral)))
        object.__setattr__(self, "logits_processor", tuple(self.logits_processor or ()))

    @property
    def active(self) -> bool:
        """True when any processor is to run (otherwise the raw logits are used as they are)."""
        return (self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0 or bool(self.bad_words_ids)
                or self.min_length > 0 or self.min_new_tokens > 0 or bool(self.suppress_tokens)
                or bool(self.logits_processor))


@dataclass(frozen=True)
class DecodeConfig:
    """One generation request.

    `stop_strings` may also be given as one string or None, `eos_token_ids` as
    one id or None; both are stored as tuples.
    """

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int | None = None                # seeds a private torch.Generator; None draws fresh entropy
    stop_strings: tuple[str, ...] = ()     # stop once the decoded text contains one of these
    eos_token_ids: tuple[int, ...] = ()    # empty: taken from the tokenizer / generation config
    ignore_eos: bool = False               # keep going past EOS (benchmarks of fixed length)
    processing: ProcessingConfig = field(default_factory=ProcessingConfig)   # logits processors at every node
    return_logprobs: bool = False          # report the target's log-probability of each emitted token

    def __post_init__(self):
        stops = _as_tuple(self.stop_strings, str)
        if any(not isinstance(s, str) or not s for s in stops):
            raise ConfigError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")
        eos = tuple(_integer("each of eos_token_ids", i, 0) for i in _as_tuple(self.eos_token_ids, numbers.Integral))
        # frozen: stored once here in their plain forms
        object.__setattr__(self, "max_new_tokens", _integer("max_new_tokens", self.max_new_tokens, 1))
        if self.seed is not None:
            object.__setattr__(self, "seed", _integer("seed", self.seed, *SEED_RANGE))
        object.__setattr__(self, "stop_strings", stops)
        object.__setattr__(self, "eos_token_ids", eos)


def _as_tuple(value, single: type) -> tuple:
    """None -> (), one `single` -> (value,), any other iterable -> tuple(value)."""
    if value is None:
        return ()
    if isinstance(value, single):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        return (value,)                 # not iterable: the caller's check names it


# Limits on a tree spec, checked before anything is built from it. The verify
# pass feeds every node to the target and the ancestor mask is (N, N), so cost
# grows with the node count; every level is one draft forward. Trees that pay
# off are tens of nodes and a handful of levels deep.
MAX_TREE_NODES = 1024   # draft nodes, the root excluded
MAX_TREE_DEPTH = 64     # levels below the root


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the draft tree grown under each round's target-initialised root.

    `spec` is either MCSD's k-config string ("4,2,2": 4 children of the root, 2
    under each of those, 2 under each of those; "1,1,1,1" is a chain of 4) or an
    explicit list of paths, Medusa style: each path is a tuple of sibling ranks
    from the root, e.g. ((0,), (1,), (0, 0)) is two children of the root and one
    grandchild under the first.
    """

    spec: str | tuple[tuple[int, ...], ...] = "4,2,2"
