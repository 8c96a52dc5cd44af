"""A draft head that reads the target's own features (EAGLE-style), and the drafter around it.

At committed position t the head reads the target's last hidden state f_t
(the vector its LM head turns into the distribution of token t+1) together with
the embedding of the token that actually followed, x_{t+1} (the target's own,
frozen, embedding). A reduction layer maps [f_t, e(x_{t+1})] to the head's
width, one or two small decoder layers (with their own KV cache) predict the
next feature f_{t+1}, and the target's LM head rows turn it into draft scores
for x_{t+2}. Deeper in the tree the head reads its *own* predicted feature in
place of f, which is why it is trained unrolled over several steps.

Conventions shared with the trainer (tools/train_feature_drafter.py):
- entry t has input (f_t, e(x_{t+1})) and position id t + 1 (the token's position);
- its output predicts f_{t+1}, scored against the target's distribution of x_{t+2}.

The LM head may score only a frequency-ranked sub-vocabulary (`vocab_ids`);
every other token gets probability 0 in q, and q stays a full distribution over
the vocabulary, so verification (the residual max(p - q, 0) included) is exact.

The drafter runs the head's decoder layers through the engine's own forward
(`mcsd.forward.llama.LeanForward` over a static cache) rather than transformers' module
code: a head step is a few small products, so the modules' own overhead was
most of it. Training calls the head's `forward` (transformers') as before.

Limitations: one sequence at a time; the head's decoder layers are Llama
layers (RMSNorm, rotary positions, SwiGLU), whatever the target's family.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from ..core.tree import DraftTree
from ..forward import kernels, kv_cache, llama, quant
from ..forward.attention import additive_mask, causal_allowed


@dataclass(frozen=True)
class FeatureHeadConfig:
    target_hidden: int                 # the target's hidden size H (width of f and of its embeddings)
    hidden: int = 0                    # the head's width; 0 = same as the target's
    layers: int = 1                    # decoder layers in the head
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 0              # MLP width; 0 = 2.5 x hidden
    rope_theta: float = 10000.0
    max_positions: int = 8192
    rms_norm_eps: float = 1e-5
    vocab_size: int = 0                # the target's vocabulary size
    sub_vocab: int = 0                 # rows of the LM head scored (0 = all)
    # v2: which of the target's hidden states the head reads at committed positions, as indices
    # into transformers' `hidden_states` (0 = embeddings, i = after decoder layer i; -1 = the
    # final, normed state). () = v1: the final state alone. Several are fused by a projection.
    feature_layers: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))

    @property
    def width(self) -> int:
        return self.hidden or self.target_hidden

    @property
    def read_layers(self) -> tuple[int, ...]:
        """The target hidden states the head reads (v1: the final one)."""
        return self.feature_layers or (-1,)


def default_feature_layers(n_layers: int) -> tuple[int, int, int]:
    """Low, middle and high layers of an n-layer target (EAGLE-3's choice of three)."""
    low, mid, high = min(2, n_layers), n_layers // 2, max(n_layers - 3, 1)
    return tuple(sorted({low, mid, high}))

class FeatureHead(nn.Module):
    """The trainable part: reduction, decoder layers, output projection back to the target's feature space.

    The LM head is *not* part of it: scores come from the target's own LM head
    rows (`lm_rows`), set with `attach_lm_head` and never saved.
    """

    def __init__(self, cfg: FeatureHeadConfig):
        super().__init__()
        from transformers import LlamaConfig, LlamaModel

        self.cfg = cfg
        w = cfg.width
        # v2: the chosen target layers, concatenated, fused into one feature of the target's width
        self.fuse = nn.Linear(len(cfg.feature_layers) * cfg.target_hidden, cfg.target_hidden, bias=False) \
            if len(cfg.feature_layers) > 1 else nn.Identity()
        self.reduce = nn.Linear(2 * cfg.target_hidden, w, bias=False)
        body_cfg = LlamaConfig(vocab_size=1, hidden_size=w, intermediate_size=cfg.intermediate or int(2.5 * w),
                               num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                               num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.max_positions,
                               rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
                               bos_token_id=None, eos_token_id=None, pad_token_id=None)   # no vocabulary of its own
        self.body = LlamaModel(body_cfg)                  # embeddings unused: we pass inputs_embeds
        self._cache_kw = kv_cache.cache_keyword(self.body)
        self.body.embed_tokens.requires_grad_(False)
        self.expand = nn.Linear(w, cfg.target_hidden, bias=False) if w != cfg.target_hidden else nn.Identity()
        self.register_buffer("vocab_ids", torch.arange(cfg.sub_vocab or cfg.vocab_size), persistent=True)
        self._set_lm(None)

    def _set_lm(self, lm: nn.Linear | None) -> None:
        # kept out of the registered modules: never saved, trained or converted with the head
        self.__dict__["lm"] = lm

    @property
    def lm_rows(self) -> torch.Tensor | None:
        """(K, H) the target's LM head rows for `vocab_ids`, or None before `attach_lm_head`."""
        return None if self.lm is None else self.lm.weight

    def attach_lm_head(self, lm_head_weight: torch.Tensor) -> None:
        """Borrow the target's LM head rows for this head's sub-vocabulary (frozen, not saved), as a
        linear layer `lm` of their own, so the matmul path a forward runs on (`mcsd.forward.kernels`,
        prepacked weights included) covers the scores too."""
        rows = lm_head_weight.detach().index_select(0, self.vocab_ids.to(lm_head_weight.device))
        lm = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
        lm.weight = nn.Parameter(rows, requires_grad=False)
        self._set_lm(lm)

    def forward(self, features, token_embeds, position_ids, attention_mask=None, past_key_values=None):
        """Predict next features.

        Args:
            features: (B, T, H) target (or predicted) features f_t.
            token_embeds: (B, T, H) embeddings of x_{t+1}.
            position_ids: (B, T).
            attention_mask: additive (B, 1, T, K) float mask, or None for causal.
        Returns:
            (B, T, H) predicted f_{t+1}.
        """
        x = self.inputs(features, token_embeds)                                       # (B, T, w)
        out = self.body(inputs_embeds=x, position_ids=position_ids, attention_mask=attention_mask,
                        use_cache=past_key_values is not None, **{self._cache_kw: past_key_values})
        return self.expand(out.last_hidden_state)

    def inputs(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """(..., H) features and (..., H) next-token embeddings -> (..., w) the body's input embeddings."""
        return self.reduce(torch.cat([features, token_embeds], dim=-1))

    def fused(self, target_states: torch.Tensor) -> torch.Tensor:
        """(..., L*H) the target's chosen hidden states, concatenated -> (..., H) the feature f_t
        the head reads at a committed position (v1: the final state, unchanged)."""
        return self.fuse(target_states)

    def sub_scores(self, predicted: torch.Tensor) -> torch.Tensor:
        """(..., H) predicted features -> (..., K) logits over the sub-vocabulary `vocab_ids`."""
        if predicted.dtype == self.lm_rows.dtype:
            return self.lm(predicted)
        return predicted @ self.lm_rows.T.to(predicted.dtype)

    def scores(self, predicted: torch.Tensor) -> torch.Tensor:
        """(..., H) predicted features -> (..., V) logits, -inf outside the sub-vocabulary."""
        return self.full_scores(self.sub_scores(predicted))

    def full_scores(self, sub: torch.Tensor) -> torch.Tensor:
        """(..., K) logits over the sub-vocabulary -> (..., V), -inf outside it."""
        if self.vocab_ids.numel() == self.cfg.vocab_size:
            return sub
        full = sub.new_full(sub.shape[:-1] + (self.cfg.vocab_size,), float("-inf"))
        return full.index_copy_(-1, self.vocab_ids.to(sub.device), sub)

    def with_feature_layers(self, feature_layers: tuple[int, ...]) -> "FeatureHead":
        """A v2 head reading `feature_layers` that drafts exactly as this v1 head does.

        The final state (-1) must be among the layers: the fusion starts as the
        projection that keeps it and drops the others, and every other weight
        is copied, so training goes on from what the v1 head learned instead of
        from scratch. The new head is trainable; this one is left unchanged.
        """
        layers = tuple(int(i) for i in feature_layers)
        if self.cfg.feature_layers:
            raise ValueError(f"this head already reads target layers {list(self.cfg.feature_layers)}")
        if len(layers) < 2 or -1 not in layers or len(set(layers)) != len(layers):
            raise ValueError(f"a v1 head widens to several distinct target layers that include -1 (the final "
                             f"state it reads), not {list(layers)}")
        wide = FeatureHead(replace(self.cfg, feature_layers=layers)).to(self.vocab_ids.device)
        missing, unexpected = wide.load_state_dict(self.state_dict(), strict=False)
        assert not unexpected and all(m == "fuse.weight" for m in missing), (missing, unexpected)
        H = self.cfg.target_hidden
        k = layers.index(-1)
        with torch.no_grad():
            wide.fuse.weight.zero_()
            wide.fuse.weight[:, k * H:(k + 1) * H] = torch.eye(H, dtype=wide.fuse.weight.dtype)
        wide._set_lm(self.lm)
        return wide

    # ---------------------------------------------------------------- files

    def save(self, directory: str | Path, card: dict | None = None) -> None:
        from safetensors.torch import save_file
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.contiguous() for k, v in self.state_dict().items() if not k.startswith("body.embed_tokens")}
        save_file(state, str(directory / "feature_head.safetensors"))
        (directory / "feature_head.json").write_text(json.dumps(asdict(self.cfg), indent=1))
        if card is not None:
            (directory / "card.json").write_text(json.dumps(card, indent=1))

    @classmethod
    def load(cls, directory: str | Path, dtype=None) -> "FeatureHead":
        """Load a saved head (safetensors: no code runs on load). Raises ValueError on a bad file."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        directory = Path(directory)
        try:
            cfg = FeatureHeadConfig(**json.loads((directory / "feature_head.json").read_text()))
            state = load_file(str(directory / "feature_head.safetensors"))
        except (OSError, TypeError, ValueError, SafetensorError) as exc:
            raise ValueError(f"{directory} does not hold a readable feature head: {exc}") from exc
        head = cls(cfg)
        missing, unexpected = head.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.startswith("body.embed_tokens")]
        if missing or unexpected:
            raise ValueError(f"{directory}: feature head weights do not match its config "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
        head.eval().requires_grad_(False)
        return head.to(dtype) if dtype is not None else head


def is_feature_head(directory: str | Path) -> bool:
    return (Path(directory) / "feature_head.json").is_file()


FIRST_READ_WINDOW = 64          # positions a feature drafter's first read of a generation takes at most


class FeatureDrafter:
    """Drafter over a `FeatureHead`, fed the target's features by the decoder.

    Cache: entry t of the head's cache was computed from the *true* feature
    f_t. Tree nodes use predicted features, so after verification only the
    root's entry is kept; the next round re-reads the accepted tokens with the
    features the verify pass produced (no extra target forward).

    window: the head's first forward of a generation reads at most this many
    of the sequence's last positions (the prompt, and any tokens generated
    before the first drafted round); None reads all. Its cost grows with the
    prompt's length (and quadratically in attention), so the window bounds
    it for long prompts. Default `FIRST_READ_WINDOW` (64): on held-out prompts of up to 862
    tokens, windows of 64 to 512 drafted with the same acceptance as the
    whole prompt, and the smallest reads least (a generation's first round
    costs about a step more where it reads 128; docs/results.md). Drafts may
    change; verification, so the output, does not.
    """

    uses_target_hidden = True

    def __init__(self, head: FeatureHead, target: nn.Module, name: str = "feature-head",
                 window: int | None = FIRST_READ_WINDOW, directory: str | Path | None = None):
        n_layers = getattr(target.config, "num_hidden_layers", None)
        bad = [i for i in head.cfg.feature_layers if n_layers is not None and not -1 <= i <= n_layers]
        if bad:
            from ..config import ConfigError
            raise ConfigError(f"feature head reads target layers {list(head.cfg.feature_layers)}, but the target "
                              f"has {n_layers} (valid: 0..{n_layers}, or -1 for the final state)")
        if window is not None and window < 1:
            from ..config import ConfigError
            raise ConfigError(f"feature drafter window must be a positive number of positions, got {window}")
        head_device, target_device = next(head.parameters()).device, target.get_input_embeddings().weight.device
        if head_device != target_device:
            from ..config import ConfigError
            raise ConfigError(f"the feature head's weights are on {head_device}, the target's on {target_device}: "
                              f"move the head first (head.to({str(target_device)!r}))")
        self.head = head
        self.name = name                                # names its device profile
        self.directory = directory                      # the folder it was loaded from (its acceptance model)
        self.window = window                            # prompt positions the head reads (None: all)
        self.embed = target.get_input_embeddings()
        if head.lm_rows is None:
            head.attach_lm_head(target.get_output_embeddings().weight)
        self.device = self.embed.weight.device
        self.dtype = self.embed.weight.dtype
        self.forwards = 0
        self.last_hidden: torch.Tensor | None = None    # (M, H) predicted features of the rows just run
        self.kernels = None                             # CPU matmul path per block size (mcsd.forward.kernels)
        self.target = target
        self.q8_layers = 0
        self._q8_act8 = False                           # the head's Q8_0 products on 8-bit activations
        self._lean: llama.LeanForward | None = None     # the head's layers on the engine's own forward
        self.cache = None
        self.follow_target_weights()
        self.reset()

    def follow_target_weights(self) -> int:
        """Beside a float32 target on the native q4 kernel, run the head's products on Q8_0 codes of its
        own weights (`quant.attach_q8`: a quarter of the bytes; a draft's rounding never reaches the
        output), on 8-bit activations where the target's run on them ("q4q8": integer products, 1.5x
        faster on the head's LM rows at one row, docs/results.md). Called when the drafter is made and
        again when the target is put on q4 weights after it (or moved between float32 and 8-bit
        activations: the codes follow); returns the layers on Q8_0 codes."""
        act8 = quant.on_8bit_activations(self.target)
        if self.q8_layers and act8 != self._q8_act8:
            quant.detach(self.module)
            self.q8_layers = 0
        if not self.q8_layers and self.dtype == torch.float32 and quant.attached(self.target) \
                and quant.kernel_name() == "native":
            self.q8_layers, self._q8_act8 = quant.attach_q8(self.module, act8=act8), act8
        return self.q8_layers

    def bound_to(self, target: nn.Module, head=None) -> "FeatureDrafter":
        """A drafter of this kind, name, window and folder over `head` (default: this one's) bound to
        `target` (a converted or copied target)."""
        return type(self)(self.head if head is None else head, target, name=self.name, window=self.window,
                          directory=self.directory)

    def rebind(self, target: nn.Module, head=None) -> "FeatureDrafter":
        """This drafter made again in place over `head` (default: this one's) and `target`, as `bound_to`
        makes a new one: for a pair cast in place (`mcsd.drafting.pair.cast_pair`), so that the drafter
        a caller holds runs in the models' new dtype. Returns self."""
        type(self).__init__(self, self.head if head is None else head, target, name=self.name, window=self.window,
                            directory=self.directory)
        return self

    def _empty_cache(self):
        """An empty cache for the head's blocks (this drafter's buffers kept where they fit)."""
        if llama.unsupported_reason(self.head.body) is None:
            if self._lean is None or self._lean.model is not self.head.body:
                self._lean = llama.LeanForward(self.head.body)
            else:
                self._lean.refresh()                     # modules replaced since (q8 codes, packed copies)
            return self._lean.empty_cache(self.cache)
        from transformers import DynamicCache
        self._lean = None
        return DynamicCache()

    def reset(self) -> None:
        self.cache = self._empty_cache()
        self.forwards = 0
        # fused target features of positions _first .. _first+len-1; positions before the head's cache
        # length are never read again and are dropped, and new states are fused once per drafted round
        self._features = torch.zeros(0, self.head.cfg.target_hidden, device=self.device, dtype=self.dtype)
        self._first = 0
        self._pending: list[torch.Tensor] = []          # (n, L*H) states observed since, not fused yet
        self._base = 0
        self._offset = 0                                # leading positions the head never read (window)
        self._restart = False                           # features were skipped: the head's cache starts over
        self._slots = torch.zeros(0, dtype=torch.long, device=self.device)
        self._pred: torch.Tensor | None = None          # (N, H) predicted feature per processed tree node

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target hidden states the decoder hands to `observe_target`, concatenated."""
        return self.head.cfg.read_layers

    def observe_target(self, hidden: torch.Tensor) -> None:
        """hidden: (n, L*H) the target's `feature_layers` states of newly committed positions (kept as
        given, fused when the head next drafts: a plain step's is an append, no inference-mode switch)."""
        self._pending.append(hidden)

    @property
    def _observed_to(self) -> int:
        """The first position whose features have not been observed (nor skipped)."""
        return self._first + self._features.shape[0] + sum(h.shape[0] for h in self._pending)

    @property
    def unfed(self) -> bool:
        """Features were skipped and none observed since: the head cannot draft until some are."""
        return self._restart and not self._pending and not self._features.shape[0]

    def skip_target(self, n: int = 1) -> None:
        """The target's features of the next `n` committed positions were not taken (plain steps far
        from the next drafted round): what the head read and was given is dropped, and its next round
        starts over from the features observed after them, as a generation's first round does (at
        most `window` of them)."""
        if self.unfed:
            self._first += n                            # already dropped: a shut gate's steps, one by one
            return
        self._first = self._observed_to + n
        if self._features.shape[0]:
            self._features = self._features[:0]
        self._pending = []
        self._restart = True

    def features_from(self, start: int) -> torch.Tensor:
        """Fused features of positions start.. (fusing what was observed since the last call)."""
        if start < self._first:
            raise RuntimeError(f"feature drafter dropped the features of position {start} already")
        kept = self._features[start - self._first:]
        if self._pending:
            # the pending rows from `start` on, the ones before it dropped without a copy (a first read
            # keeps the last `window` of a prompt's states)
            skip, rows = max(start - self._first - self._features.shape[0], 0), []
            for h in self._pending:
                if skip < h.shape[0]:
                    rows.append(h[skip:])
                skip = max(skip - h.shape[0], 0)
            if rows:
                new = self.head.fused((rows[0] if len(rows) == 1 else torch.cat(rows)).to(self.dtype))
                kept = torch.cat([kept, new]) if kept.shape[0] else new
            self._pending = []
        self._features, self._first = kept, start
        return kept

    def _run(self, feats, tokens, positions, allowed):
        prefix = kv_cache.cache_length(self.cache) - (allowed.shape[1] - tokens.numel())
        mask = additive_mask(allowed, prefix, self.dtype)
        with kernels.running(self.kernels, tokens.numel()):
            pred = self._block(feats, self.embed(tokens), positions, mask)
        self.forwards += 1
        return pred                                                               # (Q, H)

    def _block(self, feats, embeds, positions, mask):
        """(Q, H) features, (Q, H) next-token embeddings, (Q,) positions, (1, 1, Q, K) additive mask ->
        (Q, H) predicted features; the block's keys and values join the cache."""
        if not self.static_blocks:
            return self.head(feats[None], embeds[None], positions[None], mask, self.cache)[0]
        n = embeds.shape[0]                              # the head's forward over its static cache
        pred = self.fixed_block(feats, embeds, positions[None], mask, self.cache.next_slots(n))
        self.cache.length += n
        return pred

    @property
    def static_blocks(self) -> bool:
        """The head's blocks run over a static cache at given slots (`fixed_block`): what the fixed-shape
        round needs (`mcsd.decoding.fixed_round`); here, where its layers run on the engine's own forward."""
        return self._lean is not None

    def fixed_block(self, feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                    slots: torch.Tensor) -> torch.Tensor:
        """(Q, H) features, (Q, H) next-token embeddings, (1, Q) positions, (1, 1, Q, K) additive mask over
        the static cache's first K entries, (Q,) slots the block's keys and values are written at ->
        (Q, H) predicted features; the cache's length is the caller's (no host read: capturable)."""
        x = self.head.inputs(feats, embeds)[None]                                               # (1, Q, w)
        return self.head.expand(self._lean.states(x, positions, mask, self.cache, slots))[0]

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        """(K,) the token ids `begin_round` and `step` score, where the head scores a sub-vocabulary
        (every other token has draft probability 0); None where they score the whole vocabulary."""
        ids = self.head.vocab_ids
        return None if ids.numel() == self.head.cfg.vocab_size else ids

    def widen(self, scores: torch.Tensor) -> torch.Tensor:
        """(..., K) scores over `vocab_ids` -> (..., V), -inf elsewhere."""
        return self.head.full_scores(scores)

    def _scores(self, pred: torch.Tensor) -> torch.Tensor:
        with kernels.running(self.kernels, pred.shape[0] if pred.dim() > 1 else 1):
            return self.head.sub_scores(pred) if self.vocab_ids is not None else self.head.scores(pred)

    @property
    def module(self) -> nn.Module:
        """Every linear layer this drafter's forwards run: the head's and its LM rows'."""
        return nn.ModuleList([self.head, self.head.lm])

    @torch.inference_mode()
    def begin_round(self, sequence: torch.Tensor) -> torch.Tensor:
        t_end = sequence.numel() - 1                    # entries 0 .. t_end-1; the last pairs f with the root
        if self._restart:                               # features skipped since its last round
            self.cache, self._restart = self._empty_cache(), False
        cached = kv_cache.cache_length(self.cache)
        if cached == 0:                                 # a first read: at most the last `window` positions,
            self._offset = max(self._first, 0 if self.window is None else t_end - self.window)   # observed ones
        start = cached + self._offset                   # position of the first entry not read yet
        if self._observed_to < t_end:
            raise RuntimeError("feature drafter is missing target features; observe_target was not called")
        n = t_end - start
        if n < 1:
            raise RuntimeError("feature drafter has no target features before the root (skipped since its "
                               "last round and none observed after)")
        pred = self._run(self.features_from(start)[:n], sequence[start + 1:t_end + 1],
                         torch.arange(start + 1, t_end + 1, device=self.device), causal_allowed(n, self.device))
        self._base = t_end - 1 - self._offset           # cache index of the root's entry
        self._slots = torch.zeros(1, dtype=torch.long, device=self.device)
        self._pred = pred[-1:]                          # node 0 (root) -> predicted feature
        self.last_hidden = self._pred
        return self._scores(pred[-1])

    @torch.inference_mode()
    def step(self, tree: DraftTree, rows: torch.Tensor) -> torch.Tensor:
        cols = torch.cat([self._slots, rows])
        parents = tree.parents[rows]
        slot_of = torch.full((tree.size,), -1, dtype=torch.long, device=self.device)
        slot_of[self._slots] = torch.arange(self._slots.numel(), device=self.device)
        feats = self._pred[slot_of[parents]]                                         # parents' predictions
        pred = self._run(feats, tree.tokens[rows], tree.positions(self._base + self._offset + 1, rows),
                         tree.mask(rows, cols))
        self._slots = cols
        self._pred = torch.cat([self._pred, pred])
        self.last_hidden = pred
        return self._scores(pred)

    @torch.inference_mode()
    def commit(self, path: torch.Tensor) -> None:
        # Only the root's entry was computed from a true feature; keep it, drop the tree.
        kv_cache.commit(self.cache, self._base, torch.zeros(1, dtype=torch.long, device=self.device))
