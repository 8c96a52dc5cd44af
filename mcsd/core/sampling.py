"""From logits to the distributions the engine samples from, and the randomness it draws with.

The same `logits_to_probs` processes the target's and the draft's logits, so
temperature, top-k and top-p shape p_target and q_draft identically. That is
what keeps sampling exact: the output follows the *processed* target
distribution, the same one plain sampling with these settings would use.

Two ways to draw (`SamplingConfig.method`):
- "gumbel" (the default): the token at sequence position t is
  argmax_x(log p_t(x) + g_t(x)), where g_t is standard Gumbel noise that
  depends only on the seed and t (`PositionNoise`). That is an exact draw from
  p_t (the Gumbel-max trick), and the noise at t is independent of everything
  that decided p_t, so a sequence follows the target's distribution. A drafted
  token is accepted exactly when it equals that draw, so the output is the
  target's own seeded sampling whatever was drafted: the same seed gives the
  same text from any drafter, policy or tree, and from plain decoding. The
  draft ranks its candidates by the same noise (log q + g), which makes its
  first guess the target's draw whenever the two distributions agree enough.
- "rejection": multi-candidate rejection sampling (`mcsd.core.verify.accept_sampling`),
  drawing from one private generator in round order; exact too, but a seed
  repeats only while the trees do.
"""

from __future__ import annotations

import math
import secrets

import torch

from ..config import SamplingConfig
from ..forward import native


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, typical-p (the order transformers uses), then softmax.

    Args:
        logits: (..., V) raw scores.
        cfg: sampling settings; must not be greedy.
    Returns:
        (..., V) float32 probabilities, zero outside the kept set.
    """
    return processed_scores(logits, cfg).softmax(-1)


def processed_scores(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The scores sampling draws from: (..., V) float32 logits scaled by the temperature, -inf outside
    the kept set (top-k, top-p, min-p, typical-p). Their softmax is `logits_to_probs`; a Gumbel-max
    draw needs no softmax at all (`PositionNoise.draw_scores`)."""
    if cfg.greedy:
        raise ValueError("sampling needs temperature > 0; greedy decoding uses argmax")
    scores = _scaled(logits, cfg)
    if cfg.top_k and cfg.top_k < scores.shape[-1]:
        kth = torch.topk(scores, cfg.top_k, dim=-1).values[..., -1:]            # (..., 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p < 1.0:
        scores = _top_p(scores, cfg.top_p)
    if cfg.min_p > 0.0:
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs < cfg.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if cfg.typical_p < 1.0:
        scores = _typical(scores, cfg.typical_p)
    return scores


def _scaled(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """(..., V) float32 logits over the temperature, shifted so the top score is 0 before dividing: a
    tiny temperature then sends the others to -inf (the greedy limit) instead of overflowing to
    inf - inf = nan in the softmax. Below 1e-30 (which float32 would round to 0, making the top 0 / 0)
    every gap is already -inf: the same distribution."""
    scores = logits.float()
    return (scores - scores.amax(-1, keepdim=True)) / _temperature(cfg)


def _temperature(cfg: SamplingConfig) -> float:
    """What `_scaled` divides by (the native draw divides by the same, in float32 as torch does)."""
    return max(cfg.temperature, 1e-30)


PARTIAL_SORTS = ("cpu",)          # device types where top-p tries partial sorts (each checked on the host)
TOP_P_FIRST = 64                  # candidates tried first (a partial sort)
TOP_P_BIN = 0.125                 # log-probability width of the bins that bound a larger kept set
TOP_P_BINS = 512                  # bins below each row's top (64 nats); the last takes everything below


def _top_p(scores: torch.Tensor, mass: float) -> torch.Tensor:
    """Nucleus filtering: drop a token when the probability of the tokens ranked above it already
    reaches `mass` (the top token always stays). (..., V) -> (..., V), -inf where dropped.

    float32 scores on a CPU with mcsd's native library take one native call (`native.top_p`: 0.2-0.5 ms
    a row of 49,152 against 1.4-2.6 ms here, most of a sampled step's work besides the forward);
    anything else `_top_p_torch`. The two add the mass in another order (double against float32),
    so where a token's mass above lands within rounding of `mass` they may keep a token more or
    less; each is exact for its own arithmetic, and a process runs one of them throughout."""
    if _native_rows(scores):
        return native.top_p(scores, mass)
    return _top_p_torch(scores, mass)


def _top_p_torch(scores: torch.Tensor, mass: float) -> torch.Tensor:
    """`_top_p` in torch operations. The kept set is found among the top candidates of
    each row: a partial sort of 64, then of as many as a histogram of the row's log-probabilities
    says can hold `mass` (a bin past the one where it crosses, for rounding), and
    only where those still hold less than `mass` does it sort the whole vocabulary (4 ms a row for
    49,152 entries on a 2-core CPU, against about 1 ms). The decision is made on the candidates'
    descending cumulative mass either way, so every path keeps the same set. (..., V) -> (..., V)."""
    log_norm = torch.logsumexp(scores, dim=-1, keepdim=True)                       # (..., 1)
    # off the CPU one full sort: the partial sorts' checks would each read a value on the host
    for k in _top_p_sizes(scores, log_norm, mass) if scores.device.type in PARTIAL_SORTS else (None,):
        if k is None:
            top, order = torch.sort(scores, dim=-1, descending=True)
        else:
            top, order = torch.topk(scores, k, dim=-1)                              # (..., k) descending
        top = (top - log_norm).exp()                                                # their probabilities
        before = top.cumsum(-1) - top                                               # mass ranked above each
        if k is not None and not bool((before[..., -1] + top[..., -1] >= mass).all()):
            continue                                                                # some row needs more
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, order, before < mass)
        return scores.masked_fill(~keep, float("-inf"))


def _top_p_sizes(scores: torch.Tensor, log_norm: torch.Tensor, mass: float):
    """The candidate counts `_top_p` tries, in order, each made only if the one before fell short:
    `TOP_P_FIRST`, the histogram's bound (where it is less than half the vocabulary), then None (a
    full sort)."""
    vocab = scores.shape[-1]
    if TOP_P_FIRST < vocab:
        yield TOP_P_FIRST
    bound = max(_top_p_bound(scores, log_norm, mass), TOP_P_FIRST + 1)
    if bound < vocab // 2:                          # else a sort costs no more
        yield bound
    yield None


def _top_p_bound(scores: torch.Tensor, log_norm: torch.Tensor, mass: float) -> int:
    """How many top candidates hold `mass` in every row, from a histogram of log-probabilities
    (bins `TOP_P_BIN` wide below the row's top): every token of the bins up to one past the bin where
    the mass crosses. An upper bound up to rounding; `_top_p` checks it."""
    logp = (scores - log_norm).reshape(-1, scores.shape[-1])                        # (R, V)
    depth = (logp.amax(-1, keepdim=True) - logp) / TOP_P_BIN                        # inf where -inf
    idx = depth.clamp(max=TOP_P_BINS - 1).long()
    rows = logp.shape[0]
    mass_in = logp.new_zeros(rows, TOP_P_BINS).scatter_add_(1, idx, logp.exp())
    count_in = logp.new_zeros(rows, TOP_P_BINS).scatter_add_(1, idx, torch.ones_like(logp))
    crossing = (mass_in.cumsum(-1) < mass).sum(-1, keepdim=True)                    # (R, 1) the bin it crosses in
    last = (crossing + 1).clamp(max=TOP_P_BINS - 1)
    return int(count_in.cumsum(-1).gather(1, last).max())


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


def _native_rows(scores: torch.Tensor) -> bool:
    """The native library's row passes (top-p, top-k, argmax) read these scores: float32 on a CPU, the
    library built."""
    return scores.dtype == torch.float32 and scores.device.type == "cpu" and native.library() is not None


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores (R, V) -> (R, k) long, each row's k largest, largest first: float32 scores on a CPU with
    mcsd's native library in one native pass a row (`native.topk_indices`: 12-19 us a 49,152-token row
    where torch's argmax took 74 and its topk 100-250; ties to the lower index), else torch's topk."""
    if k <= 64 and _native_rows(scores):
        return native.topk_indices(scores, k)
    return scores.topk(k, dim=-1).indices


def greedy_tokens(scores: torch.Tensor) -> torch.Tensor:
    """scores (..., V) -> (...) long, `scores.argmax(-1)` (the first of equal maxima; `top_indices` with
    k = 1 where it is native)."""
    if _native_rows(scores):
        return native.argmax(scores)
    return scores.argmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of `probs` (..., V) -> (...) long, without a host sync."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def choose(scores: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None,
           logprob: bool = False, noise: PositionNoise | None = None,
           position: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """scores (V,) -> (the chosen token (): the argmax when greedy, else drawn from the processed
    distribution, by `noise` at sequence `position` where given, else from `generator`; with
    `logprob` its (1,) float32 log-probability under that distribution, else None)."""
    if cfg.greedy:
        token, dist = greedy_tokens(scores), None
    else:
        # the Gumbel draw needs no softmax: the distribution is made only to sample from it or to report it
        dist = processed_scores(scores, cfg).softmax(-1) if noise is None or logprob else None
        if noise is not None:            # the position's own draw (`draw_at`: no host read of the scores)
            token = noise.draw_at(scores[None], cfg, position)[0]
        else:
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


_MASK64 = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix(seed: int, position: int) -> int:
    """A 63-bit key from (seed, position): splitmix64's finaliser over both, so that neighbouring
    seeds and positions give unrelated streams."""
    return _finalise(seed * _GOLDEN + (position + 1) * _MIX1) >> 1


def _finalise(z: int) -> int:
    """splitmix64's finaliser of a host integer, as 64 bits."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _as_int64(c: int) -> int:
    """A 64-bit constant as the int64 holding the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> keeps the sign)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def noise_uniform(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(M,) int64 position keys x (K,) int64 token ids -> (M, K) float32 uniforms in (0, 1) (see
    `_uniform`)."""
    return _uniform(keys[:, None], ids[None, :])


def _uniform(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 position keys and token ids, broadcast together -> float32 uniforms in (0, 1): token i at a
    position with key k gets splitmix64's finaliser over k + (i + 1) * golden ratio, its top 23 bits
    centred, (2h + 1) / 2^24 (exact in float32). int64 arithmetic wraps as uint64's does; the native
    library's `noise_u` makes the same bits."""
    z = keys + (ids + 1) * _as_int64(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _as_int64(_MIX1)
    z = (z ^ _shr(z, 27)) * _as_int64(_MIX2)
    z = z ^ _shr(z, 31)
    return (2 * _shr(z, 41) + 1).float() * 2.0 ** -24


class PositionNoise:
    """Gumbel noise per sequence position and token, a function of (seed, position, token) alone.

    `draw(probs, positions)` is argmax(log probs + g_position) per row (`draw_scores`
    takes the processed scores themselves, softmax left out; `draw_logits` the raw
    logits and the sampling settings): an exact draw from each row's distribution,
    and the same draw for the same seed, position and distribution whoever asks (the
    target verifying a tree, the plain loop, another process). A token's noise is a
    hash of the position's key and its id (`noise_uniform`), so it is made only for
    the tokens asked about (the head's scored sub-vocabulary, the target's kept set),
    on whatever device asks, and never depends on what was drawn before.

    Args:
        seed: 64-bit seed; None draws one from the operating system.
        vocab: the vocabulary size (the noise's width).
        device: where the noise is used.
    """

    def __init__(self, seed: int | None, vocab: int, device):
        self.seed = secrets.randbits(63) if seed is None else int(seed) & _MASK64
        self.vocab, self.device = int(vocab), torch.device(device)

    def host_gumbel(self, position: int, token: int) -> float:
        """The standard Gumbel noise of one (position, token), on the host in double precision: what the
        draws add to that token's score at that position (`_uniform`'s bits; the draws' float32 rounding
        aside). For estimates made before a draw, never for a draw itself."""
        z = _finalise(_mix(self.seed, position) + (token + 1) * _GOLDEN)
        return -math.log(-math.log((2 * (z >> 41) + 1) * 2.0 ** -24))

    def position_keys(self, positions: torch.Tensor) -> torch.Tensor:
        """(M,) positions -> (M,) int64 keys on the CPU (one host read of the positions)."""
        return torch.tensor([_mix(self.seed, p) for p in positions.tolist()], dtype=torch.long)

    def key_at(self, position: int, device) -> torch.Tensor:
        """(1,) int64 the key of one position given as a host int, on `device`: made on the host where
        the draw is the native library's (a CPU: one small tensor, where `device_keys` takes nine tensor
        operations), else by `device_keys` (no host transfer); the same bits either way."""
        if torch.device(device).type == "cpu" and native.library() is not None:
            return torch.tensor([_mix(self.seed, position)], dtype=torch.long)
        return self.device_keys(torch.full((1,), position, dtype=torch.long, device=device))

    def device_keys(self, positions: torch.Tensor) -> torch.Tensor:
        """(M,) long positions -> (M,) int64 keys where the positions are, in torch operations: the
        same bits as `position_keys` (`_mix`), with no host read (the fixed-shape round's draws)."""
        z = (positions.long() + 1) * _as_int64(_MIX1) + _as_int64((self.seed * _GOLDEN) & _MASK64)
        z = (z ^ _shr(z, 30)) * _as_int64(_MIX1)
        z = (z ^ _shr(z, 27)) * _as_int64(_MIX2)
        return _shr(z ^ _shr(z, 31), 1)

    def keyed(self, scores: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """`keys` with position keys (M,) int64 already made (`device_keys`): (M, V) scores + g, or (M, K)
        over the tokens `ids`; no host read."""
        cols = torch.arange(scores.shape[-1], device=scores.device) if ids is None else ids.long()
        return scores.float() + self._at(keys, cols).to(scores.device)

    def draw_at(self, logits: torch.Tensor, cfg: SamplingConfig, position: int) -> torch.Tensor:
        """`draw_logits` of one row (1, V) at a position given as a host int: `draw_keyed` with the
        position's key as an int where the draw is native (no tensor made), else `key_at`'s."""
        key = _mix(self.seed, position) if _native_draw(logits, cfg) else self.key_at(position, logits.device)
        return self.draw_keyed(logits, cfg, key)

    def draw_rows(self, logits: torch.Tensor, cfg: SamplingConfig, rows: list[int], positions: list[int]) -> list[int]:
        """`draw_logits` of the given rows of logits (N, V) at host positions, as host ints: where the
        draw is native, each row on its own at its position (`draw_at`: no tensor of keys or rows
        made, no row copied); elsewhere one draw of the rows and one read, not a read a row."""
        if _native_draw(logits, cfg):
            return [int(self.draw_at(logits[r:r + 1], cfg, p)) for r, p in zip(rows, positions)]
        return self.draw_logits(logits[rows], cfg, torch.tensor(positions, device=logits.device)).tolist()

    def draw_keyed(self, logits: torch.Tensor, cfg: SamplingConfig, keys: torch.Tensor | int) -> torch.Tensor:
        """`draw_logits` with position keys (M,) int64 already made (`device_keys`; for one row drawn
        natively, its key as a host int): the same draws, no host read."""
        if _native_draw(logits, cfg):
            return native.draw(logits.float(), _temperature(cfg), cfg.top_p, keys)
        return greedy_tokens(self.keyed(processed_scores(logits, cfg), keys))

    def gumbel(self, positions: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """(M,) long positions -> (M, V) float32 standard Gumbel noise on the noise's device, or (M, K)
        for the tokens `ids` (K,) only."""
        cols = torch.arange(self.vocab, device=self.device) if ids is None else ids.long()
        return self._at(self.position_keys(positions), cols)

    def _at(self, keys: torch.Tensor, ids: torch.Tensor, pairs: bool = False) -> torch.Tensor:
        """Standard Gumbel noise for (M,) int64 position keys (on the CPU) and (K,) token ids: (M, K),
        each key with every token; with `pairs`, (M,) ids and (M,), key r with token r. On the ids'
        device: natively on a CPU where the library is built, else in torch."""
        if ids.device.type == "cpu" and native.library() is not None:
            return native.gumbel(keys, ids, pairs)
        keys = keys.to(ids.device)
        u = _uniform(keys, ids) if pairs else noise_uniform(keys, ids)
        return -torch.log(-torch.log(u))

    def keys(self, scores: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """(M, V) log-probabilities, or `processed_scores` (the same up to a constant per row), at (M,)
        positions -> (M, V) Gumbel keys scores + g; -inf outside the kept set. With `ids` (K,), the
        scores are (M, K) over those tokens and so are the keys (each token's own noise). On a CPU with
        the native library one call makes noise for the finite entries alone (a draft's nucleus keeps a
        few dozen of its sub-vocabulary's 8,192 entries; a whole row's noise takes 0.1 ms); elsewhere
        on a CPU, rows filtered down to under half their entries get noise for their finite entries only."""
        scores = scores.float()
        if scores.device.type == "cpu" and native.library() is not None and scores.dim() == 2:
            return native.keys(scores, ids, self.position_keys(positions))
        if ids is None and scores.device.type == "cpu":
            finite = torch.isfinite(scores)
            if 2 * int(finite.sum()) < finite.numel():
                rows, cols = finite.nonzero(as_tuple=True)
                out = torch.full_like(scores, float("-inf"))
                out[rows, cols] = scores[rows, cols] + self._at(self.position_keys(positions)[rows], cols, pairs=True)
                return out
        return scores + self.gumbel(positions, ids).to(scores.device)

    def draw_scores(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(M, V) `processed_scores` at (M,) positions -> (M,) long tokens: argmax(scores + g)."""
        return greedy_tokens(self.keys(scores, positions))

    def draw(self, probs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(M, V) probabilities at (M,) positions -> (M,) long tokens."""
        return self.draw_scores(probs.float().log(), positions)

    def draw_logits(self, logits: torch.Tensor, cfg: SamplingConfig, positions: torch.Tensor) -> torch.Tensor:
        """(M, V) raw logits at (M,) positions -> (M,) long tokens drawn from `processed_scores(logits,
        cfg)`. With temperature and top-p alone on a CPU with the native library, one native call per
        block of rows (`native.draw`), which makes noise only for the kept tokens that can still win;
        otherwise the processed scores and a whole noise row each. A process takes one of the two for
        a given setting throughout, so a seed's text does not depend on the trees."""
        if _native_draw(logits, cfg):
            return self.draw_keyed(logits, cfg, self.position_keys(positions))
        return self.draw_scores(processed_scores(logits, cfg), positions)


def _native_draw(logits: torch.Tensor, cfg: SamplingConfig) -> bool:
    """Whether `PositionNoise.draw_logits` draws natively: temperature and top-p only, on a CPU."""
    plain = not (cfg.top_k and cfg.top_k < logits.shape[-1]) and cfg.min_p == 0.0 and cfg.typical_p >= 1.0
    return plain and logits.device.type == "cpu" and native.library() is not None
