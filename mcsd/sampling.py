"""From logits to the distributions the engine samples from.

The same `logits_to_probs` processes the target's and the draft's logits, so
temperature, top-k and top-p shape p_target and q_draft identically. That is
what keeps rejection sampling exact: the output follows the *processed* target
distribution, the same one plain sampling with these settings would use.
"""

from __future__ import annotations

import torch

from .config import SamplingConfig


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, typical-p (the order transformers uses), then softmax.

    Args:
        logits: (..., V) raw scores.
        cfg: sampling settings; must not be greedy.
    Returns:
        (..., V) float32 probabilities, zero outside the kept set.
    """
    if cfg.greedy:
        raise ValueError("logits_to_probs needs temperature > 0; greedy decoding uses argmax")
    scores = logits.float()
    # Shifted so the top score is 0 before dividing: a tiny temperature then sends the others to -inf
    # (the greedy limit) instead of overflowing to inf - inf = nan in the softmax. Below 1e-30 (which
    # float32 would round to 0, making the top 0 / 0) every gap is already -inf: the same distribution.
    scores = (scores - scores.amax(-1, keepdim=True)) / max(cfg.temperature, 1e-30)
    if cfg.top_k and cfg.top_k < scores.shape[-1]:
        kth = torch.topk(scores, cfg.top_k, dim=-1).values[..., -1:]            # (..., 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        # Drop a token when the mass *before* it already reaches top_p; the top token always stays.
        drop_sorted = (cum - sorted_scores.softmax(-1)) >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    if cfg.min_p > 0.0:
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs < cfg.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if cfg.typical_p < 1.0:
        scores = _typical(scores, cfg.typical_p)
    return scores.softmax(-1)


def _typical(scores: torch.Tensor, mass: float) -> torch.Tensor:
    """Locally typical sampling (Meister et al., 2022): keep the tokens whose surprise -log p is
    closest to the entropy, most typical first, until their mass reaches `mass`. (..., V) -> (..., V)."""
    logp = scores.log_softmax(-1)
    p = logp.exp()
    entropy = -(p * logp).nan_to_num(nan=0.0).sum(-1, keepdim=True)            # 0 * -inf counts as 0
    gap = (-logp - entropy).abs()                                                # inf where p == 0
    order = torch.argsort(gap, dim=-1)
    p_sorted = p.gather(-1, order)
    drop_sorted = (p_sorted.cumsum(-1) - p_sorted) >= mass                      # the most typical always stays
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of `probs` (..., V) -> (...) long, without a host sync."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def choose(scores: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None,
           logprob: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """scores (V,) -> (the chosen token (): the argmax when greedy, else drawn from the processed
    distribution; with `logprob` its (1,) float32 log-probability under that distribution, else None)."""
    if cfg.greedy:
        token, dist = scores.argmax(-1), None
    else:
        dist = logits_to_probs(scores, cfg)
        token = sample(dist, generator)
    if not logprob:
        return token, None
    logp = scores.float().log_softmax(-1) if dist is None else dist.log()
    return token, logp[token].reshape(1)


def sample_without_replacement(probs: torch.Tensor, k: int,
                               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct draws per row, in draw order (Gumbel top-k).

    The i-th token is distributed as a draw from `probs` with the first i-1
    removed and the rest renormalised, which is exactly the sibling order that
    multi-candidate rejection sampling assumes.

    Args:
        probs: (M, V) probabilities.
        k: draws per row.
    Returns:
        tokens (M, k) long, and valid (M, k) bool: False where a row has fewer
        than k tokens of nonzero probability (those slots hold arbitrary ids).
    """
    u = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=torch.float32)
    gumbel = -torch.log(-torch.log(u.clamp_(min=1e-20, max=1.0 - 1e-7)))
    keys = probs.log() + gumbel                                                 # -inf where p == 0
    top = torch.topk(keys, k, dim=-1)
    return top.indices, torch.isfinite(top.values)


def make_generator(seed: int | None, device) -> torch.Generator:
    """A private generator so a seeded run is reproducible and leaves global RNG alone."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen
