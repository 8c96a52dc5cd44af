"""model.generate's options through the exact loop: processors at every tree node, logprobs, prompt lists."""


import pytest
import torch
from conftest import perturbed, pooled_chi_square_p, tiny_llama
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor, RepetitionPenaltyLogitsProcessor

from mcsd import TreeDecoder
from mcsd.config import ConfigError

PROMPT = torch.tensor([3, 17, 42, 5, 9, 11])
N_NEW = 60


class PathBonus(LogitsProcessor):
    """A path-dependent custom processor: +4 on token (sum of the sequence so far) mod V, row by row."""

    def __call__(self, input_ids, scores):
        favoured = input_ids.sum(-1) % scores.shape[-1]                      # (n,)
        return scores.index_put((torch.arange(scores.shape[0]), favoured), torch.tensor(4.0), accumulate=True)


def hf_greedy(model, **options):
    out = model.generate(PROMPT[None], max_new_tokens=N_NEW, do_sample=False, attention_mask=torch.ones(1, 6),
                         **options)
    return out[0, PROMPT.numel():].tolist()


@pytest.fixture(scope="module")
def drafts(target, random_draft):
    return {"same": target, "random": random_draft}


SETTINGS = {
    "penalty+ngram": dict(repetition_penalty=1.3, no_repeat_ngram_size=3),
    "custom": dict(logits_processor=[PathBonus()]),
}


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("draft_name", ["same", "random"])
@pytest.mark.parametrize("shape", ["static-4,2,2", "default"])
def test_greedy_with_processors_equals_hf_generate(target, drafts, setting, draft_name, shape):
    options = SETTINGS[setting]
    reference = hf_greedy(target, **{k: (LogitsProcessorList(v) if k == "logits_processor" else v)
                                     for k, v in options.items()})
    plain = hf_greedy(target)
    assert reference != plain                          # the processors change what greedy decoding writes
    if shape == "default":     # models of its own: the default decoder may prepack their weights in place
        target = tiny_llama(0)
        draft = target if draft_name == "same" else tiny_llama(1, layers=1)
        dec = TreeDecoder(target, draft, attention="sdpa")
    else:
        dec = TreeDecoder(target, drafts[draft_name], tree="4,2,2", policy="static", attention="sdpa")
    out = dec.generate(PROMPT, max_new_tokens=N_NEW, **options)
    assert out.tokens == reference
    if draft_name == "same":                           # the draft, processed alike, is always accepted
        assert all(a == 1.0 for a in out.stats.accept_by_depth)
        # (the default policy may not draft at all where this machine's costs say it does not pay)
        assert shape == "default" or out.stats.mean_accepted > 1.5
    # a GenerationConfig carries the same settings
    if setting == "penalty+ngram":
        cfg = GenerationConfig(do_sample=False, max_new_tokens=N_NEW, **options)
        assert dec.generate(PROMPT, generation_config=cfg).tokens == reference


def test_baseline_and_context_drafting_take_processors(target, drafts):
    options = dict(repetition_penalty=1.3, no_repeat_ngram_size=3)
    reference = hf_greedy(target, **options)
    assert TreeDecoder(target, None, attention="sdpa").generate_baseline(
        PROMPT, max_new_tokens=N_NEW, **options).tokens == reference
    assert TreeDecoder(target, [drafts["random"], "context"], tree="2,1", policy="static", attention="sdpa").generate(
        PROMPT, max_new_tokens=N_NEW, **options).tokens == reference


def test_min_new_tokens_bad_words_and_suppress_equal_hf(tokenizer):
    target = tiny_llama(0, eos=7)
    draft = perturbed(target, 0.3)
    plain = hf_greedy(target)
    options = dict(min_new_tokens=20, bad_words_ids=[[plain[0]], [plain[3], plain[4]]],
                   suppress_tokens=[plain[6]], repetition_penalty=1.1)
    reference = hf_greedy(target, **options)
    out = TreeDecoder(target, draft, tree="3,2,1", policy="static", attention="sdpa").generate(
        PROMPT, max_new_tokens=N_NEW, **options)
    assert out.tokens == reference
    assert 7 not in out.tokens[:20]


# ---------------------------------------------------------------------------- sampling

V_SMALL = 8


def exact_second_third_probs(model, prompt, temperature, penalty):
    """P(second and third new tokens = (a, b)) under plain sampling with a repetition penalty, by
    enumeration over the first. The third is chosen at a drafted node of the first round's tree, so
    it is where a node's own prefix matters."""
    proc = RepetitionPenaltyLogitsProcessor(penalty)

    def next_probs(rows):
        with torch.no_grad():
            return (proc(rows, model(rows).logits[:, -1]) / temperature).softmax(-1)

    p0 = next_probs(prompt[None])[0]                                          # (V,)
    one = torch.stack([torch.cat([prompt, torch.tensor([a])]) for a in range(V_SMALL)])
    p1 = next_probs(one)                                                      # (V, V): [t0, t1]
    two = torch.stack([torch.cat([prompt, torch.tensor([a, b])]) for a in range(V_SMALL) for b in range(V_SMALL)])
    p2 = next_probs(two).view(V_SMALL, V_SMALL, V_SMALL)                      # [t0, t1, t2]
    return (p0[:, None, None] * p1[:, :, None] * p2).sum(0)                   # (V, V): [t1, t2]


def test_sampling_with_repetition_penalty_follows_the_processed_target():
    target = tiny_llama(10, vocab=V_SMALL, layers=1, sharpness=6.0, hidden=16)
    draft = perturbed(target, 0.2, seed=3)
    prompt = torch.tensor([1, 2, 3])
    # below 1 the penalty rewards repeats: a strong, path-dependent pull that a node processed with
    # the wrong prefix would miss (the third token is chosen at a drafted node)
    penalty, temperature, n = 0.3, 1.0, 1500
    exact = exact_second_third_probs(target, prompt, temperature, penalty).flatten()
    unpenalised = exact_second_third_probs(target, prompt, temperature, 1.0001).flatten()
    assert (exact - unpenalised).abs().sum() > 0.1     # the penalty moves the distribution a lot
    dec = TreeDecoder(target, draft, tree="3,2", policy="static", attention="sdpa")
    counts = torch.zeros(V_SMALL * V_SMALL)
    accepted = 0
    for seed in range(n):
        out = dec.generate(prompt, max_new_tokens=3, temperature=temperature, repetition_penalty=penalty, seed=seed)
        counts[out.tokens[1] * V_SMALL + out.tokens[2]] += 1
        accepted += out.stats.accepted_per_round[0] > 0
    p = pooled_chi_square_p(counts, exact, n)
    assert p > 1e-3, f"chi-square p = {p:.2e}"
    assert accepted > n // 2        # most third tokens were decided at a drafted node


def test_do_sample_follows_transformers_rules(target, random_draft):
    dec = TreeDecoder(target, random_draft, tree="2,1", policy="static", attention="sdpa")
    greedy = dec.generate(PROMPT, max_new_tokens=10).tokens
    # do_sample=False is greedy whatever the temperature, as in model.generate
    assert dec.generate(PROMPT, max_new_tokens=10, do_sample=False, temperature=0.7).tokens == greedy
    a = dec.generate(PROMPT, max_new_tokens=10, do_sample=True, seed=3, min_p=0.05, typical_p=0.9)
    b = dec.generate(PROMPT, max_new_tokens=10, generation_config=GenerationConfig(
        do_sample=True, min_p=0.05, typical_p=0.9), seed=3)
    assert a.tokens == b.tokens
    with pytest.raises(ConfigError, match="temperature > 0"):
        dec.generate(PROMPT, do_sample=True, temperature=0.0)


# ---------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("call, pattern", [
    (dict(num_beams=4), "unsupported generation option.*num_beams"),
    (dict(assistant_model=None, penalty_alpha=0.6), "assistant_model, penalty_alpha"),
    (dict(generation_config=GenerationConfig(num_beams=4, guidance_scale=1.5)),
     "unsupported GenerationConfig field.*guidance_scale, num_beams"),
    (dict(logits_processor=[PrefixConstrainedLogitsProcessor(lambda b, ids: [1], 1)]),
     "unsupported logits processor.*PrefixConstrainedLogitsProcessor"),
    (dict(logits_processor=["not a processor"]), "must be callables"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(bad_words_ids=[[]]), "empty sequence"),
])
def test_unsupported_options_stop_with_one_line_naming_them(target, random_draft, call, pattern):
    dec = TreeDecoder(target, random_draft, tree="2,1", policy="static", attention="sdpa")
    with pytest.raises(ConfigError, match=pattern) as err:
        dec.generate(PROMPT, max_new_tokens=4, **call)
    assert "\n" not in str(err.value)


def test_pearl_and_lossy_roots_refuse_processors_and_logprobs(target, random_draft):
    pearl = TreeDecoder(target, random_draft, tree="1,1", policy="pearl", attention="sdpa")
    lossy = TreeDecoder(target, random_draft, tree="2", policy="static", attention="sdpa", lossy_target_roots=2)
    for dec, what in ((pearl, "pearl"), (lossy, "lossy_target_roots")):
        with pytest.raises(ConfigError, match=f"logits processors.*{what}"):
            dec.generate(PROMPT, max_new_tokens=4, repetition_penalty=1.2)
        with pytest.raises(ConfigError, match=f"return_logprobs.*{what}"):
            dec.generate(PROMPT, max_new_tokens=4, return_logprobs=True)


# ---------------------------------------------------------------------------- logprobs

def reference_logprobs(model, tokens, temperature=1.0):
    ids = torch.cat([PROMPT, torch.tensor(tokens)])
    with torch.no_grad():
        logits = model(ids[None]).logits[0, PROMPT.numel() - 1:-1].float()
    return (logits / temperature).log_softmax(-1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


@pytest.mark.parametrize("draft_name", ["same", "random"])
def test_logprobs_are_the_targets_own(target, drafts, draft_name):
    dec = TreeDecoder(target, drafts[draft_name], tree="4,2,2", policy="static", attention="sdpa")
    out = dec.generate(PROMPT, max_new_tokens=40, return_logprobs=True)
    assert len(out.logprobs) == len(out.tokens) == 40
    torch.testing.assert_close(torch.tensor(out.logprobs), reference_logprobs(target, out.tokens),
                               atol=1e-5, rtol=0)
    sampled = dec.generate(PROMPT, max_new_tokens=40, temperature=0.8, seed=5, output_scores=True)
    torch.testing.assert_close(torch.tensor(sampled.logprobs), reference_logprobs(target, sampled.tokens, 0.8),
                               atol=1e-5, rtol=0)
    assert dec.generate(PROMPT, max_new_tokens=4).logprobs is None


def test_logprobs_are_cut_with_the_tokens(target, drafts):
    plain = hf_greedy(target)
    eos = plain[12]
    out = TreeDecoder(target, drafts["same"], tree="4,2,2", policy="static", attention="sdpa").generate(
        PROMPT, max_new_tokens=40, eos_token_ids=eos, return_logprobs=True)
    assert out.finish_reason == "eos" and len(out.logprobs) == len(out.tokens) == plain.index(eos) + 1


# ---------------------------------------------------------------------------- several prompts

def test_a_list_of_prompts_gives_a_list_of_outputs(target, drafts, tokenizer):
    dec = TreeDecoder(target, drafts["random"], tokenizer=tokenizer, tree="2,2", policy="static", attention="sdpa")
    prompts = [PROMPT.tolist(), "w05 w06 w07", PROMPT[:3]]
    outs = dec.generate(prompts, max_new_tokens=8, return_logprobs=True)
    assert isinstance(outs, list) and len(outs) == 3
    for p, o in zip(prompts, outs):
        assert o.tokens == dec.generate(p, max_new_tokens=8).tokens and len(o.logprobs) == 8
    base = dec.generate_baseline(prompts, max_new_tokens=8)
    assert [b.tokens for b in base] == [o.tokens for o in outs]
    # a flat list of ids is still one prompt
    assert dec.generate(PROMPT.tolist(), max_new_tokens=8).tokens == outs[0].tokens


def test_a_tiny_temperature_is_the_greedy_limit_not_nan():
    from mcsd.config import SamplingConfig
    from mcsd.core.sampling import logits_to_probs
    logits = torch.tensor([0.5, 2.0, -1.0, 2.0 - 1e-3])
    for t in (1e-6, 1e-40, 1.9e-286):
        probs = logits_to_probs(logits, SamplingConfig(t, top_k=3, min_p=0.1, typical_p=0.9))
        assert torch.equal(probs, torch.tensor([0.0, 1.0, 0.0, 0.0]))
