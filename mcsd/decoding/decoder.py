"""`TreeDecoder`: the speculative decoding loop.

Prefill (the target reads the prompt and chooses the first token itself), then each round:
  1-2. propose: the drafter grows a tree beneath the root, the token the target itself chose
       last round (exact by construction), context branches merged in (`mcsd.decoding.propose`);
  3-4. verify: the target scores every node in one forward (sliced tree mask); greedy matching
       or multi-candidate rejection sampling accepts a path and the target's own next token;
  5. commit: both KV caches keep the accepted path; the policy and drafters observe the round;
  6. emit: generation stops on EOS, a stop string or `max_new_tokens` (`mcsd.core.output`).
The decoder's parts are resolved in `mcsd.decoding.resolve`, its costs and matmul paths in `mcsd.decoding.calibration`.

Limitations: one sequence at a time (several in one forward: `mcsd.decoding.batch`); models must use
transformers' DynamicCache (no sliding-window or quantised caches); under
bfloat16/float16 the tree forward's different batch shapes change rounding, so
greedy output can differ from plain decoding where two logits nearly tie
(float32 is exact).
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import torch

from ..config import (ConfigError, DecodeConfig, check_callback, check_context_window, check_lossy_roots,
                      check_tokenizer)
from ..core import processors
from ..core.output import Emission, GenerationOutput, GenerationStats, eos_ids
from ..core.sampling import PositionNoise, choose, make_generator
from ..core.tree import DraftTree
from ..core.verify import Acceptance
from ..drafting import pearl
from ..drafting.context import ContextDrafter
from ..drafting.draft import GrownTree
from ..drafting.pearl import PearlMode
from ..drafting.policies import TreePolicy, make_policy
from ..forward import hugepages, kernels
from ..forward.lm import CachedLM
from . import fixed_round, prompts, round_prices
from .accept import judge
from .calibration import Calibration
from .propose import Proposer
from .resolve import resolve


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
            which runs draft and target concurrently: see mcsd/drafting/pearl.py) or a
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
            Measuring happens here, while the decoder is built, never inside
            `generate` (see `recalibrate`); a first measurement on a busy
            machine stops after `mcsd.costs.store.CALIBRATION_BUDGET_S` and is
            marked provisional.
        threads: torch's CPU threads, chosen before anything is measured: "auto"
            (the default, as on the command line: OMP_NUM_THREADS where set,
            else the cores other processes leave free, read over 0.1 s), a
            count (at most the cores this process may use), or None to leave
            torch's setting alone. This sets torch's process-wide thread count.
        cuda_graphs: on CUDA, the engine's own forward (Llama family) runs every block
            padded to a bucket of rows and replays each bucket's forward as a CUDA
            graph captured once (`mcsd.forward.graphs`); False runs the same shapes eagerly.
        round: how a round runs: "auto" (the default) in fixed shapes on the device where the target
            sits on CUDA and the generation allows it, else the loop below; "fixed" in fixed shapes
            wherever it runs (a ConfigError where the generation does not allow it: see
            `mcsd.decoding.fixed_round`; on a CPU eagerly, for tests); "loop" always the loop.
        release_weights: False (the default) leaves the models usable as given: where the
            profile runs a model's linear layers on prepacked oneDNN weights
            (`mcsd.forward.kernels`), the copies are made beside the plain weights, which
            stay, so the models can still be cast (`cast_pair`), copied, saved or handed to
            another decoder. True lets the plain weights go where the copies serve every
            block size, saving their memory: only for models nothing else uses (the
            command line and the server load their own).

    What building a decoder does to the models: it may give linear layers a prepacked
    copy of their weight (used only while it is fresh: a layer whose weight was changed
    or cast reads its plain weight again), and sets torch's thread count (`threads`).

    Attributes:
        threads: the `mcsd.forward.threads.ThreadChoice` made (its `reason` says why), or None.
        calibration: this machine's costs and matmul paths (`mcsd.decoding.calibration`).
        costs_source: where a cost-aware policy's costs came from ("cached",
            "measured", "default"), or None for other policies.
        calibration_s, calibration_note, kernels_note: what measuring took here,
            whether it was provisional, which matmul path small blocks run on.
    """

    def __init__(self, target, draft=None, tokenizer=None, tree=None, policy="auto",
                 attention: str = "auto", policy_options: dict | None = None, lossy_target_roots: int = 0,
                 calibrate: bool | None = None, threads: int | str | None = "auto", cuda_graphs: bool = True,
                 release_weights: bool = False, round: str = "auto"):
        if not callable(getattr(target, "get_input_embeddings", None)):
            raise TypeError(f"target must be a loaded causal LM (a torch.nn.Module such as transformers' "
                            f"LlamaForCausalLM; mcsd.load_model_pair loads one), got {type(target).__name__}")
        if round not in fixed_round.ROUNDS:
            raise ConfigError(f"round must be one of {', '.join(fixed_round.ROUNDS)}, got {round!r}")
        self.round = round
        self.fixed_round: fixed_round.FixedRound | None = None   # kept between generations (its graphs too)
        self.round_choice = ("loop", "")          # the last generation's round and why (`--stats`)
        check_tokenizer(tokenizer)
        self.threads = _choose_threads(threads)
        self.target, self.tokenizer = CachedLM(target, cuda_graphs=cuda_graphs), tokenizer
        self.lossy_roots = int(lossy_target_roots)
        parts = resolve(target, draft, tree, policy, attention, self.lossy_roots, cuda_graphs,
                        fixed_round=round != "loop" and fixed_round.default_on(self.target.device))
        self.drafter, self.context, self.attention = parts.drafter, parts.context, parts.attention
        self._huge_pages()                            # before any timing: costs measured as decoding runs
        self.calibration = Calibration(self.target, self.drafter, parts.draft, calibrate, release_weights)
        self.policy = make_policy(parts.policy, parts.tree, **self.calibration.policy_options(parts.policy,
                                                                                              policy_options))
        if self.drafter is not None:
            self.policy.bind_drafter(self.drafter)
        self._baseline_policy = make_policy("static", "")
        self.context_costs = None                     # prices a context node's verify time
        if self.context is not None:
            self.context.bind(target.get_input_embeddings().weight.shape[0], self.target.device)
            self.context_costs = getattr(self.policy, "costs", None)
            if self.context_costs is None:
                self.context_costs = self.calibration.costs()
        self.calibration.choose_kernels(target_alone=self.drafter is None and self.context is None)
        # Trees live where the target's inputs live (its embedding's device under a device_map).
        for pol in (self.policy, self._baseline_policy):
            pol.topology = pol.topology.to(self.target.device)
        self.context_window = getattr(target.config, "max_position_embeddings", None)
        self._price_rounds(calibrate)

    def _price_rounds(self, calibrate: bool | None = None) -> None:
        """What a drafted round and a graft cost in decoding beyond the profile's prices, fixed for the
        run (`round_prices`): none while they are measured, the decoder's own rounds measuring them."""
        self.round_figures = None
        self.round_figures, self.round_prices = round_prices.apply(self, calibrate)
        round_prices.use(self, greedy=True)

    def _huge_pages(self) -> None:
        """The target's and the drafter's weights on transparent huge pages (`mcsd.forward.hugepages`)."""
        drafter = self.drafter
        models = [self.target.model, getattr(drafter, "module", None) or getattr(drafter, "model", None)]
        hugepages.advise(t for m in models if isinstance(m, torch.nn.Module) for t in hugepages.module_tensors(m))

    costs_source = property(lambda self: self.calibration.source)
    calibration_s = property(lambda self: self.calibration.seconds)
    calibration_note = property(lambda self: self.calibration.note)
    kernels_note = property(lambda self: self.calibration.kernels_note)

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
            options: `model.generate`'s names (see `mcsd.core.processors.request`):
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
        if prompts.is_prompt_list(prompt):
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
        if prompts.is_prompt_list(prompt):
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
        check_callback("on_round", on_round, "each round's tree and its Acceptance")
        self._check_dtype()
        prompt_ids = self.encode(prompt)
        cfg = processors.request(self.target.model, prompt_ids.numel(), max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                 stop_strings=stop_strings, ignore_eos=ignore_eos, eos_token_ids=eos_token_ids,
                                 **options)
        check_context_window(self.context_window, prompt_ids.numel(), cfg.max_new_tokens)
        if baseline:
            self.round_choice = ("loop", "plain decoding")
            if self.fixed_round is not None:
                self.fixed_round.release()          # the target's blocks as they were before it
            return (yield from self._decode(prompt_ids, cfg, Proposer(self._baseline_policy, None, None)))
        check_lossy_roots(self.lossy_roots, cfg.sampling, prompt_ids.numel(),
                          getattr(self.drafter, "uses_target_hidden", False))
        round_prices.use(self, cfg.sampling.greedy)      # a drafted round's price under this decoding
        proposer = Proposer(self.policy, self.drafter, self.context, self.lossy_roots, self.context_costs)
        if proposer.lossy:
            _exact_loop_only(cfg, "lossy_target_roots")
        rounds = fixed_round.choose(self, self.round, cfg, proposer, on_round)
        return (yield from self._decode(prompt_ids, cfg, proposer, on_round, rounds))

    def recalibrate(self, force: bool = False) -> bool:
        """Measure this machine's costs again now, where a generation found the profile in use stale
        (its rounds disagreed with it) and the machine is quiet, or always with `force`; the next
        generations run on the new costs and matmul paths. A generation never measures: a stale
        profile is flagged in the cache and measured again by the next decoder built (at the next
        start), or here, where the caller chooses the moment (the server does not: it measures at
        start-up only); a drafted round's figures beyond the new prices are measured again with them.
        Returns whether it measured."""
        if not self.calibration.remeasure(getattr(self.policy, "costs", None) or self.context_costs, force):
            return False
        self._price_rounds()
        return True

    def _check_dtype(self) -> None:
        """The models still have the dtype this decoder was built for: its caches, kernels and drafter
        were made for that one, so a pair cast since (`cast_pair`) needs a decoder of its own."""
        now = self.target.model.get_input_embeddings().weight.dtype
        if now != self.target.dtype:
            raise ConfigError(f"this TreeDecoder was built for {str(self.target.dtype).removeprefix('torch.')} "
                              f"models, and its target is {str(now).removeprefix('torch.')} now (cast since, e.g. "
                              f"by cast_pair): build a new TreeDecoder for the cast pair")

    def encode(self, prompt) -> torch.Tensor:
        """Prompt (str, list of ids, or tensor) -> (T,) long ids on the target's device."""
        vocab = self.target.model.get_input_embeddings().weight.shape[0]
        return prompts.encode(prompt, self.tokenizer, vocab, self.target.device)

    # ------------------------------------------------------------------ the loop

    @torch.inference_mode()
    def _decode(self, prompt_ids: torch.Tensor, cfg: DecodeConfig, proposer: Proposer,
                on_round=None, rounds: fixed_round.FixedRound | None = None) -> Iterator[list[int]]:
        policy, drafter = proposer.policy, proposer.drafter
        if isinstance(policy, PearlMode) and drafter is not None:    # draft and target run concurrently
            _exact_loop_only(cfg, "policy 'pearl'")
            with kernels.suspend():                             # the matmul flag is shared by both threads
                return (yield from pearl.decode(self, prompt_ids, cfg, policy, drafter))
        stats, gen = GenerationStats(), make_generator(cfg.seed, self.target.device)
        stats.round, stats.round_reason = self.round_choice
        noise = None                 # Gumbel noise by (seed, position): a seed's text whatever the trees
        if not cfg.sampling.greedy and cfg.sampling.method == "gumbel":
            vocab = self.target.model.get_input_embeddings().weight.shape[0]
            noise = PositionNoise(cfg.seed, vocab, self.target.device)
        emitted = Emission(cfg, eos_ids(cfg, self.target.model, self.tokenizer), self.tokenizer)
        proc = processors.build(cfg.processing, prompt_ids.numel(), emitted.eos)   # None: raw logits decide
        t_start = time.perf_counter()
        # 0. prefill: the target reads the prompt and chooses the first token itself
        sequence, new, new_lp = self._prefill(prompt_ids, cfg, proposer, gen, proc, noise)
        stats.target_forwards += 1
        stats.prefill_s = time.perf_counter() - t_start
        yield emitted.add(new, new_lp)
        if rounds is not None:
            rounds.start(sequence, noise, new[-1])

        while emitted.finish is None:
            if rounds is not None:   # 1-6 in fixed shapes on the device, the emitted tokens read once
                yield emitted.add(rounds.run(cfg.max_new_tokens - len(emitted.tokens), stats))
                continue
            sequence, new, new_lp = self._round(sequence, cfg, gen, proposer, proc, noise,
                                                cfg.max_new_tokens - len(emitted.tokens), stats, on_round)
            yield emitted.add(new, new_lp)

        proposer.record(stats)
        stats.wall_s = time.perf_counter() - t_start
        return emitted.output(stats)

    def _round(self, sequence: torch.Tensor, cfg: DecodeConfig, gen, proposer: Proposer, proc, noise,
               remaining: int, stats: GenerationStats,
               on_round=None) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """One round of the loop on the decoder's target cache (also a batch's lone request's round,
        `mcsd.decoding.batch`): steps 1-6 of the module's docstring.

        Args:
            sequence: (T,) the committed sequence ending with the root.
            remaining: tokens the generation may still emit.
            stats: the generation's counters, updated here.
        Returns:
            (the sequence with the round's tokens, those tokens (host ints), their log-probabilities
            with `cfg.return_logprobs` else None).
        """
        # 1-2. propose: the drafter's tree under the root, context branches merged in
        t0 = time.perf_counter()
        proposal = proposer.propose(sequence, remaining, cfg.sampling, gen, proc, noise)
        if proposal is None:         # nothing drafted or grafted: the plain loop's step, no tree
            token, new_lp = self._step(sequence, cfg, gen, proposer, proc, noise, t0)
            stats.record_step(time.perf_counter() - t0)
            if on_round is not None:                         # the step as a tree of the root alone
                on_round(DraftTree.root_only(proposer.policy.topology, sequence[-1]),
                         Acceptance(torch.zeros(1, dtype=torch.long, device=token.device), token))
            return torch.cat([sequence, token.reshape(1)]), [int(token)], new_lp
        t1 = time.perf_counter()
        # 3-4. verify every node in one target forward, then accept (the target's cache keeps the path)
        acc, path_hidden, last, new_lp = self._verify(proposal.grown, sequence, cfg, gen, proposer.policy,
                                                      proposer.hidden, proposer.lossy > 0,
                                                      proposer.context if proposer.recycles(proposal) else None,
                                                      proc, noise)
        t2 = time.perf_counter()
        # 5. commit the path to the drafter's cache; the proposers observe how the round went
        proposer.observe(proposal, acc, path_hidden, last, (t1 - t0) * 1000, (t2 - t1) * 1000,
                         self.target.forward_ms, self.target.forward_context)
        stats.record_round(proposal.grown.tree, acc.n_accepted, t1 - t0, t2 - t1)
        if on_round is not None:
            on_round(proposal.grown.tree, acc)
        # 6. emit
        new = proposal.emitted(acc, lossy=proposer.lossy > 0)
        return torch.cat([sequence, new]), new.tolist(), new_lp

    def _prefill(self, prompt_ids: torch.Tensor, cfg: DecodeConfig, proposer: Proposer, gen, proc,
                 noise: PositionNoise | None = None):
        """The target reads the prompt (T,) and, unless the round's roots are its top-W (lossy), chooses
        the first token. Only the last row is projected onto the vocabulary: the prompt's other rows
        would give context drafting recycled predictions for prompt tokens, but the projection costs
        more than they gain (a long prompt's, without native bfloat16, more than the n-gram source's
        copies then save).

        Returns:
            (the committed sequence ending with the root, the tokens to emit, their log-probabilities
            with `cfg.return_logprobs` else None).
        """
        proposer.reset()
        self.target.reset()
        hidden = proposer.step_hidden()     # the target layers the drafter reads, unless it drafts nothing soon
        out = self.target.extend(prompt_ids, hidden=hidden, last_logits=True)
        logits, prompt_hidden = out if hidden else (out, None)
        proposer.start(prompt_ids, logits, prompt_hidden)
        if proposer.lossy:              # the target's top-W are the next round's candidate roots; nothing emitted
            return prompt_ids, [], None
        scores = logits[-1] if proc is None else proc.at_prefix(prompt_ids, logits[-1])
        root, new_lp = choose(scores, cfg.sampling, gen, cfg.return_logprobs, noise, prompt_ids.numel())
        return torch.cat([prompt_ids, root.reshape(1)]), [int(root)], new_lp

    def _step(self, sequence: torch.Tensor, cfg: DecodeConfig, gen, proposer: Proposer, proc, noise, t0: float):
        """The plain loop's step, for a round that drafts and grafts nothing (every plain round, and
        every round of `generate_baseline`): the target reads the root `sequence[-1]` ((T,) the
        committed sequence) and draws the next token from its logits, as the prefill draws the first.

        Returns:
            (the next token (), with `cfg.return_logprobs` its (1,) float32 log-probability else None).
        """
        hidden = proposer.step_hidden()
        out = self.target.extend(sequence[-1:], hidden=hidden)
        logits, states = out if hidden else (out, None)                          # (1, V), (1, H)
        scores = logits[-1] if proc is None else proc.at_prefix(sequence, logits[-1])
        token, new_lp = choose(scores, cfg.sampling, gen, cfg.return_logprobs, noise, sequence.numel())
        proposer.observe_step(sequence[-1:], logits, states, (time.perf_counter() - t0) * 1000,
                              self.target.forward_ms, self.target.forward_context)
        return token, new_lp

    def _verify(self, grown: GrownTree, sequence: torch.Tensor, cfg: DecodeConfig, gen, policy: TreePolicy,
                hidden: bool | tuple[int, ...] = False, skip_root: bool = False,
                context: ContextDrafter | None = None, proc: processors.NodeScores | None = None,
                noise: PositionNoise | None = None):
        """One target forward over the tree's nodes, the acceptance rule, and the target cache commit.

        `sequence` (T,) is the committed sequence ending with the root; `proc`
        processes each node's logits with that node's own prefix. Sampling with
        `noise`: the target's draw after each node is the Gumbel-max token at the
        next position, and a node is accepted exactly as under greedy matching.

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
        tree = grown.tree
        prefix = self.target.length
        anc = tree.mask()                                                  # (N, N), sliced from the topology
        s = int(skip_root)                                                 # rows of the tree fed to the target
        out = self.target.forward(tree.tokens[s:], tree.positions(prefix - s)[s:], anc[s:, s:], hidden=hidden)
        logits, states = out if hidden else (out, None)                   # (N-s, V), (N-s, H)
        verdict = judge(grown, sequence, logits, cfg, gen, policy, skip_root, context, proc, noise)
        self.target.commit(prefix, verdict.kept)
        return (verdict.acc, (states[verdict.kept] if hidden else None), verdict.last, verdict.emitted_lp)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _collect(rounds: Iterator[list[int]], streamer) -> GenerationOutput:
        check_callback("streamer", streamer, "each round's new token ids")     # before the loop starts
        while True:
            try:
                new = next(rounds)
            except StopIteration as done:
                return done.value
            if streamer is not None and new:
                streamer(new)


def _choose_threads(threads: int | str | None):
    """TreeDecoder's `threads` argument -> the ThreadChoice applied to torch (None: left alone)."""
    from ..forward import threads as cpu_threads
    if threads is None:
        return None
    if threads == "auto":
        choice = cpu_threads.auto()
    elif isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1:
        choice = cpu_threads.explicit(threads, "threads=")
    else:
        raise ConfigError(f"threads must be 'auto', None or an integer >= 1, got {threads!r}")
    return cpu_threads.apply(choice)


def _exact_loop_only(cfg: DecodeConfig, what: str) -> None:
    """ConfigError when `cfg` asks for what only the exact tree loop provides."""
    asked = [name for name, on in (("logits processors / processor options", cfg.processing.active),
                                   ("return_logprobs", cfg.return_logprobs)) if on]
    if asked:
        raise ConfigError(f"{' and '.join(asked)} need the exact tree loop; {what} does not support them")
