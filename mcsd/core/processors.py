"""Hugging Face generation options through the exact loop: a request, and logits processors at tree nodes.

`request` turns `model.generate`-style arguments (a `GenerationConfig` and/or
keywords of the same names) into a `DecodeConfig`, refusing with one line any
option it does not implement. `NodeScores` applies the resulting processors.

Exactness with processors: a processor's output depends on the sequence it
follows (a repetition penalty on the tokens already there, an n-gram ban on
the last n-1 tokens, a minimum length on the length). Plain decoding applies
it to the target's logits with the committed sequence; here every tree node is
a possible next position, so the processors run on the target's logits at
every node with *that node's own* prefix: prompt + committed output + the
node's ancestors in the tree. The target's processed distribution at a node
is then exactly what plain decoding would use had it reached that node, and
greedy matching / rejection sampling against it keeps the output identical
(greedy) or equal in distribution (sampling). The draft's logits are processed
the same way at each node it expands, so that it proposes from (nearly) the
distribution it is tested against: that only raises acceptance.

Vectorised: the nodes of one depth share a prefix length, so one call of the
processor list takes all of them as a batch ((n, T + d) input ids, (n, V)
scores); a verify pass makes one call per depth, a draft step one call.

Supported: `repetition_penalty`, `no_repeat_ngram_size`, `bad_words_ids`,
`min_length`, `min_new_tokens`, `suppress_tokens`, and a `logits_processor`
list of the transformers classes in `SUPPORTED_PROCESSORS` or of the caller's
own processors. A caller's processor is called with a batch of tree nodes at
once and more than once per emitted token (for the draft's proposals and for
verification), so it must treat each row on its own (as transformers'
processors do for a batch) and keep no state between calls. Sampling warpers
(`temperature`, `top_k`, `top_p`, `min_p`, `typical_p`) run after the
processors, as in transformers. Refused with a `ConfigError` naming them:
beam search and its options, assisted generation options, guidance, forced
tokens, watermarking and the other transformers processors not listed.
"""

from __future__ import annotations

import torch

from ..config import ConfigError, DecodeConfig, ProcessingConfig, SamplingConfig

# The transformers processors that treat each row of a batch on its own and keep no state
# between calls: safe to run at many tree nodes at once.
SUPPORTED_PROCESSORS = (
    "RepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor", "NoBadWordsLogitsProcessor",
    "SequenceBiasLogitsProcessor", "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor",
    "SuppressTokensLogitsProcessor", "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper",
    "MinPLogitsWarper", "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper",
    "InfNanRemoveLogitsProcessor", "LogitNormalization", "ExponentialDecayLengthPenalty",
)

SAMPLING_OPTIONS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p")
PROCESSING_OPTIONS = ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "min_length",
                      "min_new_tokens", "suppress_tokens")
# Everything `request` takes besides the decoder's own arguments.
OPTIONS = SAMPLING_OPTIONS + PROCESSING_OPTIONS + (
    "max_new_tokens", "max_length", "eos_token_id", "stop_strings", "output_scores", "return_logprobs",
    "logits_processor", "generation_config", "sampling_method")
# GenerationConfig fields that carry no decoding choice for one sequence here (ids of special
# tokens a batch would pad with, output format switches, bookkeeping): read and left alone.
INERT_FIELDS = ("transformers_version", "_from_model_config", "pad_token_id", "bos_token_id",
                "decoder_start_token_id", "return_dict_in_generate", "use_cache", "renormalize_logits",
                "output_attentions", "output_hidden_states")


class _Unset:
    """The default of a decoder argument the caller did not give (None, given, is checked like any value)."""

    def __repr__(self) -> str:
        return "<default>"


UNSET = _Unset()


def request(model, prompt_len: int, *, max_new_tokens=UNSET, temperature=UNSET, top_k=UNSET, top_p=UNSET,
            seed=None, stop_strings=None, ignore_eos=False, eos_token_ids=None, **options) -> DecodeConfig:
    """One generation request from the decoder's arguments and `model.generate`-style options.

    Two ways to say how tokens are chosen:
    - mcsd's own: `temperature` (0, the default, is greedy), `top_k` (0 = off),
      `top_p`, and optionally `min_p`, `typical_p`;
    - `model.generate`'s: with `do_sample` or a `generation_config`, the choice
      follows transformers' rules: `do_sample=False` is greedy whatever the
      temperature; unset values come from the given config, then the target's
      own `generation_config`, then transformers' defaults (temperature 1,
      top_k 50).
    Processor options and `logits_processor` apply in both.

    Args:
        model: the target (its `generation_config` supplies defaults in the second way).
        prompt_len: prompt tokens (a `max_length` counts them).
        max_new_tokens, temperature, top_k, top_p, seed, stop_strings,
            ignore_eos, eos_token_ids: as `TreeDecoder.generate` (UNSET = not given).
        options: the `model.generate` names in `OPTIONS`; `generation_config`
            a `transformers.GenerationConfig`; `logits_processor` a list or
            `LogitsProcessorList`; `return_logprobs` / `output_scores` ask for
            the target's log-probability of each emitted token.
    Returns:
        DecodeConfig.
    Raises:
        ConfigError naming any option, config field or processor that is not supported.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"unsupported generation option(s): {', '.join(unknown)} "
                          f"(supported: {', '.join(OPTIONS)})")
    gen_cfg = options.pop("generation_config", None)
    given = {k: v for k, v in options.items() if v is not None}
    for name, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature), ("top_k", top_k),
                        ("top_p", top_p)):
        if value is not UNSET:
            given[name] = value
    for name, value in (("stop_strings", stop_strings), ("eos_token_id", eos_token_ids)):
        if value is not None:
            given[name] = value
    from_config = _fields(gen_cfg) if gen_cfg is not None else {}
    settings = {**from_config, **given}
    if gen_cfg is not None or "do_sample" in given:          # model.generate's rules
        own = _fields(getattr(model, "generation_config", None), strict=False)
        defaults = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}
        settings = {**defaults, **{k: v for k, v in own.items() if k in SAMPLING_OPTIONS + PROCESSING_OPTIONS},
                    **settings}
        if not settings["do_sample"]:
            settings["temperature"] = 0.0
        elif not settings["temperature"] > 0.0:
            raise ConfigError(f"do_sample=True needs temperature > 0, got {settings['temperature']}")
    sampling = SamplingConfig(settings.get("temperature", 0.0), settings.get("top_k", 0),
                              settings.get("top_p", 1.0), settings.get("min_p", 0.0),
                              settings.get("typical_p", 1.0), settings.get("sampling_method", "gumbel"))
    processing = ProcessingConfig(
        repetition_penalty=settings.get("repetition_penalty", 1.0),
        no_repeat_ngram_size=settings.get("no_repeat_ngram_size", 0),
        bad_words_ids=settings.get("bad_words_ids", ()), min_length=settings.get("min_length", 0),
        min_new_tokens=settings.get("min_new_tokens", 0), suppress_tokens=settings.get("suppress_tokens", ()),
        logits_processor=check_processors(settings.get("logits_processor")))
    new_tokens = settings.get("max_new_tokens", 128)
    if "max_new_tokens" not in settings and "max_length" in settings:   # transformers' total: the prompt included
        new_tokens = settings["max_length"] - prompt_len
        if new_tokens < 1:
            raise ConfigError(f"max_length {settings['max_length']} leaves no room after the prompt "
                              f"({prompt_len} tokens)")
    return DecodeConfig(max_new_tokens=new_tokens,
                        sampling=sampling, seed=seed, stop_strings=settings.get("stop_strings", ()),
                        eos_token_ids=settings.get("eos_token_id"), ignore_eos=ignore_eos, processing=processing,
                        return_logprobs=bool(settings.get("return_logprobs") or settings.get("output_scores")))


def _fields(gen_cfg, strict: bool = True) -> dict:
    """The settings a GenerationConfig holds, by option name. With `strict`, a field that would change
    decoding and is not supported here is a ConfigError; without, such fields are skipped (the target's
    own config: the caller did not ask for them)."""
    if gen_cfg is None:
        return {}
    if not hasattr(gen_cfg, "to_dict"):
        raise ConfigError(f"generation_config must be a transformers GenerationConfig, got {type(gen_cfg).__name__}")
    from transformers import GenerationConfig
    neutral = GenerationConfig().to_dict()
    neutral.update({"num_beams": 1, "num_return_sequences": 1, "length_penalty": 1.0, "early_stopping": False,
                    "output_logits": False, "remove_invalid_values": False, "typical_p": 1.0,
                    "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_length": 0, "top_p": 1.0})
    out, refused = {}, []
    for name, value in gen_cfg.to_dict().items():
        if name in OPTIONS:
            if value is not None:
                out[name] = value
        elif name not in INERT_FIELDS and value is not None and value != neutral.get(name):
            refused.append(name)
    if refused and strict:
        raise ConfigError(f"unsupported GenerationConfig field(s): {', '.join(sorted(refused))} "
                          f"(mcsd decodes one sequence, greedy or sampled, with: {', '.join(OPTIONS[:-1])})")
    if "eos_token_id" in out and isinstance(out["eos_token_id"], int):
        out["eos_token_id"] = (out["eos_token_id"],)
    return out


def check_processors(processors) -> tuple:
    """The caller's `logits_processor` list as a tuple; ConfigError naming any that is not supported."""
    if processors is None:
        return ()
    if callable(processors) and not isinstance(processors, (list, tuple)):
        processors = [processors]
    items = list(processors)
    bad = [type(p).__name__ for p in items if not callable(p)]
    if bad:
        raise ConfigError(f"logits_processor entries must be callables (input_ids, scores) -> scores; "
                          f"got {', '.join(bad)}")
    refused = [type(p).__name__ for p in items if type(p).__module__.startswith("transformers.")
               and type(p).__name__ not in SUPPORTED_PROCESSORS]
    if refused:
        raise ConfigError(f"unsupported logits processor(s): {', '.join(refused)} (supported from transformers: "
                          f"{', '.join(SUPPORTED_PROCESSORS)}; or your own, row by row and stateless)")
    return tuple(items)


class NodeScores:
    """A processor list applied to logits at tree nodes, each node with its own prefix.

    Args:
        processors: callables (input_ids (n, L) long, scores (n, V) float32) -> (n, V) scores.
    """

    def __init__(self, processors: list):
        self.processors = processors

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for proc in self.processors:
            scores = proc(input_ids, scores)
        return scores

    def at_prefix(self, prefix: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """prefix (T,) tokens, logits (V,) after them -> (V,) float32 processed scores."""
        return self(prefix[None], logits.float()[None].clone())[0]

    def at_nodes(self, committed: torch.Tensor, tree, rows: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Processed scores after tree nodes.

        Args:
            committed: (T-1,) the committed tokens before the tree's root.
            tree: the DraftTree (parents stored before children).
            rows: (M,) node indices; logits: (M, V) logits after each of them.
        Returns:
            (M, V) float32 scores, row i processed with prefix committed + the
            path root .. rows[i].
        """
        scores = logits.float().clone()                        # processors may write in place
        depth = tree.depth[rows]
        levels = depth.unique().tolist()                       # one host copy; a call per depth
        out = scores if len(levels) == 1 else torch.empty_like(scores)
        for d in levels:
            sel = (depth == d).nonzero().squeeze(1) if len(levels) > 1 else None
            nodes = rows if sel is None else rows[sel]
            anc = tree.mask(nodes, torch.arange(tree.size, device=rows.device))     # (n, N) ancestors-or-self
            # breadth-first order puts each node's ancestors in increasing index: the root first
            path = tree.tokens[None].expand(nodes.numel(), -1)[anc].view(nodes.numel(), d + 1)
            ids = torch.cat([committed[None].expand(nodes.numel(), -1), path], dim=1)   # (n, T + d)
            if sel is None:
                out = self(ids, scores)
            else:
                out[sel] = self(ids, scores[sel])
        return out


def build(processing: ProcessingConfig, prompt_len: int, eos: set[int]) -> NodeScores | None:
    """The processor list for one generation in transformers' order; None when there is nothing to apply.

    Args:
        processing: the options.
        prompt_len: prompt tokens (where `min_new_tokens` starts counting).
        eos: the token ids that end generation (what the minimum lengths hold back).
    """
    if not processing.active:
        return None
    from transformers.generation.logits_process import (
        MinLengthLogitsProcessor,
        MinNewTokensLengthLogitsProcessor,
        NoBadWordsLogitsProcessor,
        NoRepeatNGramLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SuppressTokensLogitsProcessor,
    )
    eos_ids = sorted(eos)
    procs = []
    if processing.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(float(processing.repetition_penalty)))
    if processing.no_repeat_ngram_size:
        procs.append(NoRepeatNGramLogitsProcessor(processing.no_repeat_ngram_size))
    if processing.bad_words_ids:
        procs.append(NoBadWordsLogitsProcessor([list(s) for s in processing.bad_words_ids],
                                               eos_ids or None))
    if processing.min_length and eos_ids:
        procs.append(MinLengthLogitsProcessor(processing.min_length, eos_ids))
    if processing.min_new_tokens and eos_ids:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, processing.min_new_tokens, eos_ids))
    if processing.suppress_tokens:
        procs.append(SuppressTokensLogitsProcessor(list(processing.suppress_tokens)))
    procs.extend(processing.logits_processor)
    return NodeScores(procs)


def log_probs(scores: torch.Tensor, sampling: SamplingConfig, probs: torch.Tensor | None = None) -> torch.Tensor:
    """(M, V) float32 log-probabilities of the distribution a token is chosen from: the processed
    scores' log-softmax (greedy), or the log of the sampled distribution `probs` (after the warpers)."""
    if probs is not None:
        return probs.float().log()
    return scores.float().log_softmax(-1)

