"""`TreeDecoder`: the speculative decoding loop.

Each round:
  1. the root is the token the target itself chose last round (exact by construction);
  2. the drafter grows a tree beneath it, one forward per level;
  3. the target scores every tree node in one forward (sliced tree mask);
  4. greedy matching or multi-candidate rejection sampling picks the accepted
     path and the target's own next token;
  5. both KV caches keep the accepted path and drop the rest;
  6. the accepted tokens are emitted, and generation stops on EOS, a stop
     string or `max_new_tokens`.

Limitations: one sequence at a time (batch size 1); models must use
transformers' DynamicCache (no sliding-window or quantised caches); under
bfloat16/float16 the tree forward's different batch shapes change rounding, so
greedy output can differ from plain decoding where two logits nearly tie
(float32 is exact).
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import torch

from . import kernels, processors
from .attention import set_backend
from .config import ConfigError, DecodeConfig, check_context_window
from .context import ContextDrafter
from .draft import Drafter, GrownTree, ModelDrafter, grow_tree
from .lm import CachedLM
from .models import check_vocab_sizes
from .output import GenerationOutput, GenerationStats
from .pearl import PearlMode
from .policies import POLICIES, TreePolicy, make_policy, resolve_policy
from .sampling import logits_to_probs, make_generator, sample
from .tree import DraftTree
from .verify import Acceptance, accept_greedy, accept_sampling


class TreeDecoder:
    """Lossless multi-candidate tree speculative decoding for one target and one drafter.

    Args:
        target: a transformers causal LM (eval mode).
        draft: a draft causal LM sharing the target's tokenizer, any object
            implementing the `Drafter` protocol, a `ContextDrafter` (or
            "context": free proposals from the prompt, the output so far and the
            target's recycled predictions), a list of one model drafter and one
            context drafter (both merged into one tree), or None (only
            `generate_baseline` is then available).
        tokenizer: used for string prompts, decoding, EOS and stop strings.
        tree: tree spec ("4,2,2", "1,1,1,1", or a list of rank paths); the
            largest tree the policy may grow. None: the policy's own default.
        policy: policy name ("auto", "static", "heuristic", "confidence",
            "learned", the papers' "svip", "disco", "specdecpp", or "pearl",
            which runs draft and target concurrently: see mcsd/pearl.py) or a
            TreePolicy. "auto" (the default, as on the
            command line) is the learned policy with this machine's calibrated
            costs where its acceptance model is installed, else "static".
        attention: "auto" | "sdpa" | "xformers" | "eager".
        lossy_target_roots: W > 0 switches to the MCSD paper's own variant: each
            round's roots are the target's top-W tokens, each verified with its
            own drafted subtree, and the longest accepted branch is kept. It is
            NOT lossless (a non-argmax root can win) and is greedy only; 0 (the
            default) keeps the exact target-initialised single root.
        calibrate: for a cost-aware policy: None (default) uses this machine's
            cached cost profile and measures one (a few seconds, once per
            machine, pair, dtype and thread count) when there is none, or
            when the cached one was measured on a busy machine or rounds
            contradicted it and the machine is quiet now; True measures
            again; False never measures (cached profile, else a generic
            default). Without a drafter nothing is measured (unless True):
            the target's matmul paths come from any cached profile of it.

    Attributes:
        costs_source: where a cost-aware policy's costs came from ("cached",
            "measured", "default"), or None for other policies.
    """

    def __init__(self, target, draft=None, tokenizer=None, tree=None, policy="auto",
                 attention: str = "auto", policy_options: dict | None = None, lossy_target_roots: int = 0,
                 calibrate: bool | None = None):
        self.target = CachedLM(target)
        self.lossy_roots = int(lossy_target_roots)
        draft, self.context = _split_drafters(draft)
        if self.context is not None and self.lossy_roots:
            raise ConfigError("context drafting is exact-only; it cannot be combined with lossy_target_roots")
        if self.context is not None and draft is None:
            if policy not in ("auto", "static"):
                raise ConfigError(f"policy {policy!r} shapes a draft model's tree; context drafting alone "
                                  f"(no draft model) takes no policy")
            policy, tree = "static", ""                 # nothing to draft with a model: the root alone, then context
        policy = resolve_policy(policy, lossy=self.lossy_roots > 0, drafting=draft is not None)
        if tree is None and isinstance(policy, str):
            tree = POLICIES[policy].default_tree if policy in POLICIES else TreePolicy.default_tree
        if self.lossy_roots and policy == "pearl":
            raise ConfigError("PEARL drafts exact chains; it does not combine with lossy_target_roots")
        if self.lossy_roots:
            vocab = target.get_input_embeddings().weight.shape[0]
            if not 1 <= self.lossy_roots <= vocab or not isinstance(tree, str):
                raise ConfigError(f"lossy_target_roots needs a width between 1 and the vocabulary size ({vocab}) "
                                  f"and a k-config tree string")
            # candidate roots form the first level; the drafted tree grows beneath each of them
            tree = f"{self.lossy_roots},{tree}" if tree.strip() not in ("", "0") else str(self.lossy_roots)
        self.attention = set_backend(target, attention)
        if draft is None:
            self.drafter = None
        elif isinstance(draft, torch.nn.Module):
            check_vocab_sizes(target, draft)
            set_backend(draft, attention)
            self.drafter = ModelDrafter(draft)
        elif all(hasattr(draft, m) for m in ("begin_round", "step", "commit", "reset")):
            self.drafter = draft
        else:
            raise ConfigError(f"draft must be a causal LM or a Drafter, got {type(draft).__name__}")
        self.tokenizer = tokenizer
        options = dict(policy_options or {})
        self.costs_source = None
        self.calibration_s, self.calibration_note = 0.0, None    # time spent measuring here, for --stats
        self._profiled = (target, draft)              # what a stale profile is measured again for
        fetched = []                                  # this machine's profile, looked up once

        def device_profile():
            if not fetched:
                fetched.append(self._device_profile(target, draft, calibrate))
                self._note_calibration(*fetched[0])
            return fetched[0]

        def device_costs():
            costs = self._costs_of(*device_profile())
            costs.on_stale = self._stale_marker(target, draft)
            return costs

        if isinstance(policy, str) and getattr(POLICIES.get(policy), "uses_device_profile", False) \
                and "costs" not in options:
            options["costs"] = device_costs()
        if "costs" in options:
            self.costs_source = options["costs"].source
        self.policy = make_policy(policy, tree, **options)
        if self.drafter is not None:
            self.policy.bind_drafter(self.drafter)
        self._baseline_policy = make_policy("static", "")
        self.context_costs = None                     # prices a context node's verify time
        if self.context is not None and isinstance(self.policy, PearlMode):
            raise ConfigError("the pearl mode drafts a chain with a draft model; it does not take context drafting")
        if self.context is not None:
            self.context.bind(target.get_input_embeddings().weight.shape[0], self.target.device)
            self.context_costs = getattr(self.policy, "costs", None)
            if self.context_costs is None:
                self.context_costs = device_costs()
                self.costs_source = self.context_costs.source
        self.kernels_note = None                      # which matmul path small blocks run on, for --stats
        if kernels.packable(self.target.dtype, self.target.device):
            alone = self.drafter is None and self.context is None and not calibrate
            # the target alone needs only its paths: from any cached profile of it, never measured
            self._use_kernels(self._target_profile(target) if alone else device_profile()[0])
        # Trees live where the target's inputs live (its embedding's device under a device_map).
        for pol in (self.policy, self._baseline_policy):
            pol.topology = pol.topology.to(self.target.device)
        self.context_window = getattr(target.config, "max_position_embeddings", None)

    # ------------------------------------------------------------------ public API

    def generate(self, prompt, max_new_tokens: int = processors.UNSET, temperature: float = processors.UNSET,
                 top_k: int = processors.UNSET, top_p: float = processors.UNSET, seed: int | None = None,
                 stop_strings=None, ignore_eos: bool = False, eos_token_ids=None,
                 streamer: Callable[[list[int]], None] | None = None,
                 on_round: Callable[[DraftTree, Acceptance], None] | None = None,
                 **options) -> GenerationOutput | list[GenerationOutput]:
        """Generate with tree speculative decoding.

        Args:
            prompt: a string (tokenised as is; apply a chat template first if
                wanted), a list of token ids, or a (T,) / (1, T) tensor; or a
                list of such prompts, generated one after another (not batched).
            max_new_tokens: default 128.
            temperature, top_k, top_p, seed: as in plain sampling; temperature
                0 (the default) is greedy, top_k 0 and top_p 1 are off.
            stop_strings: stop once the decoded new text contains one of them.
            ignore_eos: keep generating past EOS.
            eos_token_ids: token id(s) that end generation; default: the
                model's generation config and the tokenizer's EOS.
            streamer: called with each round's newly emitted tokens.
            on_round: called with each round's tree and its Acceptance (for
                inspection and drawing; off the hot path when None).
            options: `model.generate`'s names (see `mcsd.processors.request`):
                `generation_config`, `do_sample`, `min_p`, `typical_p`,
                `repetition_penalty`, `no_repeat_ngram_size`, `bad_words_ids`,
                `min_length`, `min_new_tokens`, `suppress_tokens`,
                `eos_token_id`, `max_length`, `logits_processor` (a list of
                LogitsProcessor), `return_logprobs` / `output_scores`. Anything
                else is a ConfigError naming it. Processors and logprobs need
                the exact loop: not with policy "pearl" or lossy_target_roots.
        Returns:
            GenerationOutput (a list of them for a list of prompts). Its tokens
            follow exactly the target's own *processed* distribution under these
            settings (token-identical to `model.generate` with the same settings
            when greedy, in float32).
        """
        if self.drafter is None and self.context is None:
            raise ConfigError("this TreeDecoder has no draft; pass draft=... or use generate_baseline()")
        if _is_prompt_list(prompt):
            return [self.generate(p, max_new_tokens, temperature, top_k, top_p, seed, stop_strings, ignore_eos,
                                  eos_token_ids, streamer, on_round, **options) for p in prompt]
        return self._collect(self.stream(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_strings,
                                         ignore_eos, eos_token_ids, on_round=on_round, **options), streamer)

    def generate_baseline(self, prompt, max_new_tokens: int = processors.UNSET,
                          temperature: float = processors.UNSET, top_k: int = processors.UNSET,
                          top_p: float = processors.UNSET, seed: int | None = None,
                          stop_strings=None, ignore_eos: bool = False, eos_token_ids=None,
                          streamer: Callable[[list[int]], None] | None = None,
                          **options) -> GenerationOutput | list[GenerationOutput]:
        """Plain target-only decoding through the same loop (a tree of just the root); takes what
        `generate` takes, a list of prompts included."""
        if _is_prompt_list(prompt):
            return [self.generate_baseline(p, max_new_tokens, temperature, top_k, top_p, seed, stop_strings,
                                           ignore_eos, eos_token_ids, streamer, **options) for p in prompt]
        return self._collect(self.stream(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_strings,
                                         ignore_eos, eos_token_ids, baseline=True, **options), streamer)

    def stream(self, prompt, max_new_tokens: int = processors.UNSET, temperature: float = processors.UNSET,
               top_k: int = processors.UNSET, top_p: float = processors.UNSET, seed: int | None = None,
               stop_strings=None, ignore_eos: bool = False, eos_token_ids=None, baseline: bool = False,
               on_round: Callable[[DraftTree, Acceptance], None] | None = None,
               **options) -> Iterator[list[int]]:
        """Generator over the same loop: yields each round's new tokens; returns the GenerationOutput.
        Takes one prompt and `generate`'s options."""
        prompt_ids = self.encode(prompt)
        cfg = processors.request(self.target.model, prompt_ids.numel(), max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                 stop_strings=stop_strings, ignore_eos=ignore_eos, eos_token_ids=eos_token_ids,
                                 **options)
        self._check_length(prompt_ids.numel(), cfg.max_new_tokens)
        policy = self._baseline_policy if baseline else self.policy
        if not baseline:
            self._refresh_stale_costs()                 # between generations, never within one
        drafter = None if baseline else self.drafter
        context = None if baseline else self.context
        return (yield from self._decode(prompt_ids, cfg, policy, drafter, on_round, context))

    def encode(self, prompt) -> torch.Tensor:
        """Prompt (str, list of ids, or tensor) -> (T,) long ids on the target's device."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ConfigError("the prompt is empty")
            if self.tokenizer is None:
                raise ConfigError("a string prompt needs a tokenizer; pass tokenizer=... or token ids")
            ids = self.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        else:
            ids = _as_ids(prompt)
            if ids.dim() == 2:
                if ids.shape[0] != 1:
                    raise ConfigError(f"batched prompts are not supported (got batch size {ids.shape[0]})")
                ids = ids[0]
            if ids.dim() != 1:
                raise ConfigError(f"prompt ids must be 1-D or (1, T), got shape {tuple(ids.shape)}")
        if ids.numel() == 0:
            raise ConfigError("the prompt is empty")
        vocab = self.target.model.get_input_embeddings().weight.shape[0]
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ConfigError(f"prompt token ids must lie in [0, {vocab}); got {int(ids.min())}..{int(ids.max())}")
        return ids.to(self.target.device)

    # ------------------------------------------------------------------ the loop

    @torch.inference_mode()
    def _decode(self, prompt_ids: torch.Tensor, cfg: DecodeConfig, policy: TreePolicy,
                drafter: Drafter | None, on_round=None, context: ContextDrafter | None = None) -> Iterator[list[int]]:
        if isinstance(policy, PearlMode) and drafter is not None:    # draft and target run concurrently
            _exact_loop_only(cfg, "policy 'pearl'")
            from . import pearl
            with kernels.suspend():                             # the matmul flag is shared by both threads
                return (yield from pearl.decode(self, prompt_ids, cfg, policy, drafter))
        stats, gen = GenerationStats(), make_generator(cfg.seed, self.target.device)
        eos = self._eos_ids(cfg)
        proc = processors.build(cfg.processing, prompt_ids.numel(), eos)   # None: raw logits decide
        t_start = time.perf_counter()
        policy.reset()
        if drafter is not None:
            drafter.reset()

        # Prefill: the target reads the prompt and chooses the first token itself. Only the last
        # row is projected onto the vocabulary: the prompt's other rows would give context drafting
        # recycled predictions for prompt tokens, but the projection costs more than they gain (a
        # long prompt's, without native bfloat16, more than the n-gram source's copies then save).
        self.target.reset()
        wants_hidden = drafter is not None and getattr(drafter, "uses_target_hidden", False)
        if wants_hidden:                                        # which target layers it reads (default: the last)
            wants_hidden = tuple(getattr(drafter, "feature_layers", (-1,)))
            logits, prompt_hidden = self.target.extend(prompt_ids, hidden=wants_hidden, last_logits=True)
            drafter.observe_target(prompt_hidden)               # features of every prompt position
        else:
            logits = self.target.extend(prompt_ids, last_logits=True)
        if context is not None:
            context.reset(prompt_ids)
            context.observe_logits(prompt_ids[-1:], logits[-1:])   # the prompt's last token's, recycled
        lossy = self.lossy_roots if drafter is not None else 0
        if lossy and not cfg.sampling.greedy:
            raise ConfigError("lossy_target_roots is defined for greedy decoding only (temperature 0)")
        if lossy:   # the target's top-W become the next round's candidate roots; nothing emitted yet
            _exact_loop_only(cfg, "lossy_target_roots")
            roots, sequence, new, new_lp = logits[-1].topk(lossy).indices, prompt_ids, [], None
        else:
            scores = logits[-1] if proc is None else proc.at_prefix(prompt_ids, logits[-1])
            root, new_lp = self._choose(scores, cfg, gen)
            sequence, new = torch.cat([prompt_ids, root.reshape(1)]), [int(root)]
        stats.target_forwards += 1
        stats.prefill_s = time.perf_counter() - t_start
        out: list[int] = []
        logprobs: list[float] | None = [] if cfg.return_logprobs else None
        finish = self._emit(out, new, cfg, eos, logprobs, new_lp)
        yield out[:]
        drafted_accepts: list[int] = []                         # per round, the drafted part's accepted count

        while finish is None:
            remaining = cfg.max_new_tokens - len(out)
            depth = min(policy.begin_round(), remaining - (0 if lossy else 1)) if drafter is not None else 0
            if lossy:
                depth = max(depth, 1)                           # the candidate roots are this round's level 1
            # 1-2. draft a tree under the target-initialised root
            t0 = time.perf_counter()
            grown = (grow_tree(drafter, policy, sequence, depth, cfg.sampling, gen,
                               root_children=roots if lossy else None, scores=proc) if depth > 0
                     else GrownTree(DraftTree.root_only(policy.topology, sequence[-1]), None))
            drafted, graft = grown.tree, None
            if context is not None:                             # free branches from the context, merged in
                costs = self.context_costs
                spent_ms = self._round_ms(drafted, costs)        # from costs, not this run's clock
                probs = policy.node_probabilities()
                expected = self._expected_tokens(policy, drafted_accepts, drafted.size)
                graft = context.graft(drafted, sequence, expected, spent_ms, costs,
                                      probs if probs is not None and probs.numel() == drafted.size else None)
                grown = grown.with_graft(graft)
            t1 = time.perf_counter()
            # 3-4. verify every node in one target forward, then accept
            acc, path_hidden, last, new_lp = self._verify(grown, sequence, cfg, gen, policy, wants_hidden,
                                                          bool(lossy), context, proc)
            t2 = time.perf_counter()
            # 5. commit the accepted path into both caches
            if wants_hidden:
                drafter.observe_target(path_hidden)               # features of root .. deepest accepted
            if drafter is not None and depth > 0:
                drafter.commit(acc.path)
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            stats.target_forwards += 1
            stats.record_round(grown.tree, acc.n_accepted)
            if graft is not None:
                context.observe(graft, acc.path)
            # the policy hears about its own tree: the accepted path's drafted part
            drafted_accepts.append(int((acc.path < drafted.size).sum()) - 1)
            policy.observe(drafted_accepts[-1], drafted)
            policy.observe_timing(grown.tree, (t1 - t0) * 1000, (t2 - t1) * 1000)
            if on_round is not None:
                on_round(grown.tree, acc)
            # 6. emit
            new = grown.tree.tokens[acc.path[1:]]
            if lossy:
                roots = last.topk(lossy).indices
            else:
                new = torch.cat([new, acc.next_token.reshape(1)])
            sequence = torch.cat([sequence, new])
            before = len(out)
            finish = self._emit(out, new.tolist(), cfg, eos, logprobs, new_lp)
            yield out[before:]

        if drafter is not None:
            stats.draft_forwards = drafter.forwards
        if context is not None:
            stats.context_nodes, stats.context_accepted = context.proposed_nodes, context.accepted_nodes
        stats.policy_s = getattr(policy, "predict_s", 0.0)
        stats.new_tokens = len(out)
        stats.wall_s = time.perf_counter() - t_start
        text = self.tokenizer.decode(out, skip_special_tokens=True) if self.tokenizer is not None else None
        return GenerationOutput(tokens=out, text=text, stats=stats, finish_reason=finish, logprobs=logprobs)

    def _verify(self, grown: GrownTree, sequence: torch.Tensor, cfg: DecodeConfig, gen, policy: TreePolicy,
                hidden: bool | tuple[int, ...] = False, skip_root: bool = False,
                context: ContextDrafter | None = None, proc: processors.NodeScores | None = None):
        """One target forward over the tree's nodes, the acceptance rule, and the target cache commit.

        `sequence` (T,) is the committed sequence ending with the root; `proc`
        processes each node's logits with that node's own prefix.

        With skip_root (the lossy multi-root variant) the root is the last
        committed token, already in the cache, and its children are the
        candidate roots: every node but the root is fed, and the first level is
        accepted as given.

        Returns:
            (Acceptance; with `hidden` (True, or target layer indices) those hidden
            states along the newly committed path (else None); the target's logits
            (V,) after the deepest accepted node; with `cfg.return_logprobs` the
            (k+1,) float32 log-probabilities of the emitted tokens, else None).
        """
        tree, sampling = grown.tree, cfg.sampling
        prefix = self.target.length
        anc = tree.mask()                                                  # (N, N), sliced from the topology
        s = int(skip_root)                                                 # rows of the tree fed to the target
        out = self.target.forward(tree.tokens[s:], tree.positions(prefix - s)[s:], anc[s:, s:], hidden=hidden)
        logits, states = out if hidden else (out, None)                   # (N-s, V), (N-s, H)
        if policy.wants_target_logits and not skip_root:
            policy.observe_target(tree, logits)
        if proc is not None:                     # the processed distribution at each node, with its own prefix
            logits = proc.at_nodes(sequence[:-1], tree, torch.arange(tree.size, device=logits.device), logits)
        p_target = None
        if sampling.greedy:
            argmax = logits.argmax(-1)
            if skip_root:   # the root's row is not computed; its children are accepted as given
                argmax = torch.cat([argmax.new_full((1,), -1), argmax])
            acc = accept_greedy(tree.tokens, tree.parents, tree.depth, anc, argmax,
                                given=(tree.depth == 1) if skip_root else None)
        else:
            p_target = logits_to_probs(logits, sampling)
            q_draft = grown.q_draft.to(p_target.device) if grown.q_draft is not None else None
            acc = accept_sampling(tree.tokens, tree.parents, p_target, q_draft, gen,
                                  deterministic=grown.deterministic)
        kept = acc.path[s:] - s                                            # rows of the fed block
        if context is not None:                  # the target's predictions along the accepted path, recycled
            context.observe_logits(tree.tokens[acc.path], logits[kept])
        self.target.commit(prefix, kept)
        emitted_lp = None
        if cfg.return_logprobs:                  # row path[j] is the distribution the j-th emitted token came from
            emitted = torch.cat([tree.tokens[acc.path[1:]], acc.next_token.reshape(1)])
            dist = logits[kept].float().log_softmax(-1) if p_target is None else p_target[kept].log()
            emitted_lp = dist.gather(1, emitted[:, None]).squeeze(1)
        return acc, (states[kept] if hidden else None), logits[acc.path[-1] - s], emitted_lp

    # ------------------------------------------------------------------ helpers

    def _use_kernels(self, prof) -> None:
        """Run each forward on the matmul path the profile measured faster for its size."""
        if prof is None:
            return
        from .profile import drafter_module
        notes = []
        runners = [("target", "verify", self.target, self.target.model)]
        if self.drafter is not None and hasattr(self.drafter, "kernels"):
            runners.append(("draft", "draft", self.drafter, drafter_module(self.drafter)))
        for label, role, runner, module in runners:
            runner.kernels = table = prof.kernel_table(role)
            if table is None:
                continue
            notes.append(f"{label}: {table.describe()}")
            if table.uses_packed and module is not None:       # prepacked weights are made once, here
                kernels.pack(module)
        self.kernels_note = "; ".join(notes) or None

    @staticmethod
    def _round_ms(tree: DraftTree, costs) -> float:
        """A round's time before context nodes, in ms, from the costs alone (so that the graft, and
        the output, do not depend on how long this run's forwards happened to take): the draft
        forwards that grew `tree` (one per level but the last, over that level's nodes) and its
        verify."""
        if costs is None:
            return 0.0
        widths = torch.bincount(tree.depth).tolist()[:-1]                 # nodes per level fed to the drafter
        return sum(costs.draft_ms(w) for w in widths) + costs.verify_ms(tree.size)

    def _refresh_stale_costs(self) -> None:
        """Measure again, on a quiet machine, where the last generation found the profile stale
        (`mcsd.profile.Costs`), and run the next one on the new kernel paths and costs. The costs
        are updated in place (the policy and context drafting share them)."""
        costs = getattr(self.policy, "costs", None) or self.context_costs
        if costs is None or costs.stale is None or not self._quiet():
            return
        target, draft = self._profiled
        prof, source = self._device_profile(target, draft, calibrate=True)
        self._note_calibration(prof, source)
        costs.rebase(self._costs_of(prof, source))
        self.costs_source = source
        if kernels.packable(self.target.dtype, self.target.device):
            self._use_kernels(prof)

    @staticmethod
    def _quiet() -> bool:
        from .profile import quiet_now
        return quiet_now()

    def _note_calibration(self, prof, source: str) -> None:
        """Remember what measuring cost this run and whether it was provisional, for --stats."""
        if prof is None or source != "measured":
            return
        self.calibration_s += prof.meta.get("calibration_s", 0.0)
        if prof.meta.get("provisional"):
            self.calibration_note = f"; provisional: {prof.meta['provisional']}"

    @staticmethod
    def _stale_marker(target, draft):
        """on_stale for Costs: flag the cached profile so that the next start measures again."""
        from .profile import mark_stale
        timed = draft if isinstance(draft, torch.nn.Module) or getattr(draft, "uses_target_hidden", False) else None
        return lambda reason: mark_stale(target, timed, reason)

    @staticmethod
    def _target_profile(target):
        """A cached profile with the target's costs (alone or from a pair's), measuring nothing."""
        from .profile import load_target_costs
        return load_target_costs(target)

    @staticmethod
    def _device_profile(target, draft, calibrate: bool | None = None):
        """(this machine's profile for the pair or None, where it came from): the cached one,
        measured when missing (or when `calibrate` is True); None with `calibrate=False` and
        nothing cached."""
        from .profile import load_cached, load_or_measure
        timed = draft if isinstance(draft, torch.nn.Module) or getattr(draft, "uses_target_hidden", False) else None
        prof = None if calibrate else load_cached(target, timed, remeasure=calibrate is None)
        if prof is not None:
            return prof, "cached"
        if calibrate is False:
            return None, "default"
        return load_or_measure(target, timed, force=True), "measured"

    @staticmethod
    def _costs_of(prof, source: str):
        """Costs from a profile (see `_device_profile`); generic defaults without one."""
        from .profile import Costs
        return Costs.from_profile(prof, source=source) if prof is not None else Costs.default()

    @staticmethod
    def _device_costs(target, draft, calibrate: bool | None = None):
        """This machine's costs for the pair (see `_device_profile`)."""
        return TreeDecoder._costs_of(*TreeDecoder._device_profile(target, draft, calibrate))

    @staticmethod
    def _expected_tokens(policy: TreePolicy, drafted_accepts: list[int], drafted_size: int) -> float:
        """Tokens this round should emit before context nodes: 1 for the root alone, else the
        policy's estimate for its tree where it has one, else 1 + the mean accepted from drafted
        trees in recent rounds (context branches' acceptances are not the drafter's)."""
        if drafted_size == 1:                     # the root alone: it is the one token for sure
            return 1.0
        own = policy.expected_tokens()
        if own is not None:
            return own
        recent = drafted_accepts[-16:]
        return 1.0 + sum(recent) / max(len(recent), 1)

    @staticmethod
    def _choose(scores: torch.Tensor, cfg: DecodeConfig, gen) -> tuple[torch.Tensor, torch.Tensor | None]:
        """scores (V,) -> (the chosen token (), its (1,) float32 log-probability with `return_logprobs`)."""
        if cfg.sampling.greedy:
            token, dist = scores.argmax(-1), None
        else:
            dist = logits_to_probs(scores, cfg.sampling)
            token = sample(dist, gen)
        if not cfg.return_logprobs:
            return token, None
        logp = scores.float().log_softmax(-1) if dist is None else dist.log()
        return token, logp[token].reshape(1)

    def _emit(self, out: list[int], new: list[int], cfg: DecodeConfig, eos: set[int],
              logprobs: list[float] | None = None, new_logprobs: torch.Tensor | None = None) -> str | None:
        """Append new tokens (and their log-probabilities to `logprobs`, when kept), cut at EOS / stop
        string / length. Returns the finish reason or None."""
        if logprobs is not None:
            logprobs.extend(new_logprobs.tolist())
        finish = self._finish(out, new, cfg, eos)
        if logprobs is not None:
            del logprobs[len(out):]
        return finish

    def _finish(self, out: list[int], new: list[int], cfg: DecodeConfig, eos: set[int]) -> str | None:
        start = len(out)
        out.extend(new)
        if not cfg.ignore_eos:
            for i in range(start, len(out)):
                if out[i] in eos:
                    del out[i + 1:]
                    return "eos"
        if cfg.stop_strings and self.tokenizer is not None:
            cut = self._stop_string_cut(out, start, cfg.stop_strings)
            if cut is not None:
                del out[cut:]
                return "stop_string"
        if len(out) >= cfg.max_new_tokens:
            del out[cfg.max_new_tokens:]
            return "length"
        return None

    def _stop_string_cut(self, out: list[int], start: int, stops: tuple[str, ...]) -> int | None:
        # Find the first new token whose arrival completes a stop string.
        # Any stop string completed this round ends within the new tokens; a window of
        # earlier tokens covers one that began before them.
        lo = max(0, start - 32)
        for end in range(start + 1, len(out) + 1):
            text = self.tokenizer.decode(out[lo:end], skip_special_tokens=False)
            if any(s in text for s in stops):
                return end
        return None

    def _eos_ids(self, cfg: DecodeConfig) -> set[int]:
        if cfg.eos_token_ids:
            return set(cfg.eos_token_ids)
        ids: set[int] = set()
        gen_cfg = getattr(self.target.model, "generation_config", None)
        for source in (getattr(gen_cfg, "eos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source is not None:
                ids.update(int(i) for i in source)
        return ids

    def _check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        check_context_window(self.context_window, prompt_len, max_new_tokens)

    @staticmethod
    def _collect(rounds: Iterator[list[int]], streamer) -> GenerationOutput:
        while True:
            try:
                new = next(rounds)
            except StopIteration as done:
                return done.value
            if streamer is not None and new:
                streamer(new)


def _exact_loop_only(cfg: DecodeConfig, what: str) -> None:
    """ConfigError when `cfg` asks for what only the exact tree loop provides."""
    asked = [name for name, on in (("logits processors / processor options", cfg.processing.active),
                                   ("return_logprobs", cfg.return_logprobs)) if on]
    if asked:
        raise ConfigError(f"{' and '.join(asked)} need the exact tree loop; {what} does not support them")


def _is_prompt_list(prompt) -> bool:
    """True for a list / tuple of prompts (strings, id lists or 1-D tensors), False for one prompt."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(p, (str, list, tuple)) or (isinstance(p, torch.Tensor) and p.dim() >= 1)
                    for p in prompt))


def _split_drafters(draft):
    """`draft` as given -> (model drafter or None, ContextDrafter or None)."""
    items = list(draft) if isinstance(draft, (list, tuple)) else [draft]
    model, context = None, None
    for item in items:
        if isinstance(item, str) and item == "context":
            item = ContextDrafter()
        if isinstance(item, ContextDrafter):
            if context is not None:
                raise ConfigError("draft lists at most one context drafter")
            context = item
        elif item is not None:
            if model is not None:
                raise ConfigError("draft lists at most one model drafter (a causal LM or a Drafter) "
                                  "and one context drafter")
            model = item
    return model, context


def _as_ids(prompt) -> torch.Tensor:
    """A list / array / tensor of token ids as a long tensor; ConfigError for anything else."""
    try:
        ids = torch.as_tensor(prompt)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise ConfigError(f"prompt must be a string, or token ids as a list or tensor of integers; "
                          f"got {type(prompt).__name__}") from None
    if ids.numel() and (ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool):
        raise ConfigError(f"prompt token ids must be integers, got {ids.dtype}")
    return ids.long()
