"""`BatchDecoder`: several requests decoded together, one target forward a round over every slot's rows.

A request takes a slot: its own cache length, positions, seed, generator, processors, proposer and
emission. Each round:
  0. admit: waiting requests join free slots (at a round boundary);
  1. propose: a prefilling slot offers its prompt's next chunk (all slots' chunks together under the
     round's prompt budget); a decoding slot its tree beneath its root (context drafting grafts
     branches where the decoder has it, at most the slot's share of the round's rows, which shrinks
     as slots join: `mcsd.decoding.row_budget`; otherwise the root alone, its last token);
  2. verify: one forward over every slot's rows, flat, each block under its own mask over its own slot
     (`mcsd.forward.slots`);
  3. accept and commit per slot, with the lone round's own judgement (`mcsd.decoding.accept`);
  4. emit: a finished request leaves its slot, free for the next round.

Every answer is the one the request gets decoded alone (`TreeDecoder.generate`): greedy matching and
the seeded Gumbel draw pick each token from the target's own logits at that position, whatever was
proposed, and the noise is keyed by the request's seed and the token's position, never by the batch;
the batched forward gives a row the logits its lone forward gives it (bit for bit on the native q4
layers; see `mcsd.forward.slots` for dense models). Rejection sampling ("rejection") is exact in
distribution but, as alone, repeats a seed's text only while the trees do.

Limitations: the target runs on the engine's own forward (a Llama-family model); a model drafter
(standalone draft or feature head) does not draft in a batch: slots propose from context drafting
where the decoder has it, else decode plainly (their answers are the same, only fewer tokens a
round); lossy_target_roots is refused (not lossless). On CUDA the round runs in fixed shapes, captured as CUDA
graphs (`mcsd.forward.slots.SlotBlocks`): every slot, each block padded to the round's bucket of rows.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ..config import ConfigError, DecodeConfig, check_context_window
from ..core import processors
from ..core.output import Emission, GenerationOutput, GenerationStats, eos_ids
from ..core.sampling import PositionNoise, choose, make_generator
from ..drafting.policies import make_policy
from ..forward.attention import causal_allowed
from ..forward.slots import Block, SlotBlocks, SlotCache, SlotForward
from .accept import judge
from .propose import Proposal, Proposer
from .row_budget import RowBudget

PREFILL_TOKENS = 256            # prompt tokens a round feeds, over all prefilling slots together


@dataclass(eq=False)
class Request:
    """One request's sequence in a batch, from waiting to done.

    Attributes:
        id: the order it was submitted in.
        prompt_ids: (T,) the prompt.
        cfg: its generation settings.
        slot: the slot it holds while decoding, else None.
        new: the tokens the last round emitted for it.
        output: its GenerationOutput once done, else None.
        error: what ended it where its own part of a round raised (a processor of its own, say): it
            alone fails, its slot freed; the others go on.
        rows: rows it fed per round (its share of each round's forward).
    """

    id: int
    prompt_ids: torch.Tensor
    cfg: DecodeConfig
    emitted: Emission
    proposer: Proposer
    gen: torch.Generator
    noise: PositionNoise | None
    proc: processors.NodeScores | None
    stats: GenerationStats = field(default_factory=GenerationStats)
    slot: int | None = None
    fed: int = 0                                  # prompt tokens in the slot's cache
    sequence: torch.Tensor | None = None          # committed tokens ending with the root, once prefilled
    new: list[int] = field(default_factory=list)
    output: GenerationOutput | None = None
    cancelled: bool = False
    error: Exception | None = None
    rows: list[int] = field(default_factory=list)
    t_start: float = 0.0

    @property
    def done(self) -> bool:
        return self.output is not None or self.cancelled or self.error is not None


class BatchDecoder:
    """A `TreeDecoder`'s target, tokenizer and context drafting, decoding up to `max_batch` requests together.

    Args:
        decoder: the `TreeDecoder` whose parts run (its target must run on the engine's own forward).
        max_batch: slots: requests decoded at once; more wait (first come, first served).
        prefill_tokens: prompt tokens a round feeds over all prefilling slots (a long prompt goes in
            chunks, so the others' rounds go on meanwhile).
        fixed_shapes: run the round in fixed shapes (`SlotBlocks`: every slot, blocks padded to
            buckets), captured as CUDA graphs where the decoder's target is on CUDA with graphs on; None
            (the default): on CUDA only. False: the flat batch of the blocks' own rows (`SlotForward`).

    Attributes:
        rounds: batched forwards so far; last_rows: rows the last one fed; last_batch: slots it fed.
    """

    def __init__(self, decoder, max_batch: int = 4, prefill_tokens: int = PREFILL_TOKENS,
                 fixed_shapes: bool | None = None):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if not isinstance(prefill_tokens, int) or prefill_tokens < 1:
            raise ConfigError(f"prefill_tokens must be an integer >= 1, got {prefill_tokens!r}")
        if decoder.lossy_roots:
            raise ConfigError("batched decoding is lossless only: lossy_target_roots is not supported")
        self.decoder, self.max_batch, self.prefill_tokens = decoder, max_batch, prefill_tokens
        target = decoder.target
        try:
            lean = target.lean_forward()
        except ValueError as exc:
            raise ConfigError(f"batched decoding needs a model the engine's own forward runs ({exc})") from None
        cuda = target.device.type == "cuda"
        if fixed_shapes is None:
            fixed_shapes = cuda
        self.forward = (SlotBlocks(lean, target.model, target.kernels, capture=cuda and target.cuda_graphs)
                        if fixed_shapes else SlotForward(lean, target.model, target.kernels))
        self.cache = SlotCache.for_model(lean, max_batch)
        lone_rows = 1 + (decoder.context.config.max_nodes if decoder.context is not None else 0)
        self.budget = RowBudget(decoder.context_costs, lone_rows)     # trees sized by the load
        self.vocab = target.model.get_input_embeddings().weight.shape[0]
        self.device = target.device
        self.waiting: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * max_batch
        self._ids = itertools.count()
        self.rounds, self.last_rows, self.last_batch = 0, 0, 0

    # ------------------------------------------------------------------ requests

    def submit(self, prompt, max_new_tokens: int = processors.UNSET, temperature: float = processors.UNSET,
               top_k: int = processors.UNSET, top_p: float = processors.UNSET, seed: int | None = None,
               stop_strings=None, ignore_eos: bool = False, eos_token_ids=None, **options) -> Request:
        """Queue one prompt with `TreeDecoder.generate`'s options; it joins a slot at the next round
        with one free. A bad option is a ConfigError here, before anything runs."""
        dec = self.decoder
        dec._check_dtype()                                   # its caches and kernels were made for that dtype
        prompt_ids = dec.encode(prompt)
        cfg = processors.request(dec.target.model, prompt_ids.numel(), max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                 stop_strings=stop_strings, ignore_eos=ignore_eos, eos_token_ids=eos_token_ids,
                                 **options)
        check_context_window(dec.context_window, prompt_ids.numel(), cfg.max_new_tokens)
        noise = None                 # Gumbel noise by (seed, position): the request's text whatever the batch
        if not cfg.sampling.greedy and cfg.sampling.method == "gumbel":
            noise = PositionNoise(cfg.seed, self.vocab, self.device)
        emitted = Emission(cfg, eos_ids(cfg, dec.target.model, dec.tokenizer), dec.tokenizer)
        context = dec.context.sibling() if dec.context is not None else None
        policy = make_policy("static", "")                     # the root; context grafts beneath it
        policy.topology = policy.topology.to(self.device)
        proposer = Proposer(policy, None, context, 0, dec.context_costs)
        request = Request(next(self._ids), prompt_ids, cfg, emitted, proposer, make_generator(cfg.seed, self.device),
                          noise, processors.build(cfg.processing, prompt_ids.numel(), emitted.eos))
        self.waiting.append(request)
        return request

    def cancel(self, request: Request) -> None:
        """End a request now: it leaves its slot (or the queue); no more tokens come for it."""
        request.cancelled = True
        if request in self.waiting:
            self.waiting.remove(request)
        if request.slot is not None:
            self._leave(request)

    @property
    def active(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active

    def generate(self, prompts: list, **options) -> list[GenerationOutput]:
        """Decode every prompt (each with the same options), up to `max_batch` at once; the outputs in
        the prompts' order, each what `TreeDecoder.generate` gives that prompt alone."""
        requests = [self.submit(p, **options) for p in prompts]
        while not all(r.done for r in requests):
            self.step()
        return [r.output for r in requests]

    # ------------------------------------------------------------------ the round

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """One round over every slot. Returns the requests it advanced (their `new` tokens; `output`
        set on those that finished, `error` on those that failed; both have left their slots). An
        exception in the forward itself, which all share, is raised (the slots' states are then unknown:
        `cancel` every active request)."""
        self._admit()                                                    # 0. join at the round boundary
        t0 = time.perf_counter()
        failed: list[Request] = []
        self.last_rows = self.last_batch = 0
        plan = self._propose(failed)                                     # 1. every slot's rows
        if not plan:
            return failed
        t1 = time.perf_counter()
        logits = self.forward(self.cache, [block for _, block, _ in plan])   # 2. one forward, flat
        t2 = time.perf_counter()
        self.rounds += 1
        self.last_rows, self.last_batch = sum(b.tokens.numel() for _, b, _ in plan), len(plan)
        advanced = failed
        for (request, block, proposal), rows in zip(plan, logits):      # 3-4. per slot
            request.rows.append(block.tokens.numel())
            request.stats.record_batch(block.tokens.numel(), self.last_rows, self.last_batch)
            try:
                if proposal is None:
                    self._prefilled(request, block, rows, t2 - t1)
                else:
                    self._accept(request, proposal, rows, t1 - t0, t2 - t1)
            except Exception as exc:                                     # this request fails alone
                self._fail(request, exc)
                advanced.append(request)
                continue
            if request.sequence is not None:
                advanced.append(request)
            if request.emitted.finish is not None:
                self._finish(request)
        return advanced

    def _admit(self) -> None:
        for slot, held in enumerate(self.slots):
            if held is None and self.waiting:
                request = self.waiting.popleft()
                request.slot, request.t_start = slot, time.perf_counter()
                self.slots[slot] = request
                self.cache.free(slot)
                request.proposer.reset()

    def _propose(self, failed: list[Request]) -> list[tuple[Request, Block, Proposal | None]]:
        """Each active slot's block: a prompt chunk (None proposal) or its round's tree; a request whose
        proposal raised goes to `failed` instead.

        The prompt chunks come first (under the round's prompt budget); then each decoding slot grafts
        its tree priced as part of the round (`RowBudget.beside`): a node joins where its expected
        tokens pay for what its row adds to the whole forward, beside every row already planned and
        the roots still to come. The slot that chooses first turns with the rounds."""
        plan, budget = [], self.prefill_tokens
        decoding = []
        for request in self.active:
            request.new = []
            total = request.prompt_ids.numel()
            if request.fed >= total:
                decoding.append(request)
                continue
            if budget <= 0:                                  # prefill, in chunks under the round's budget
                continue
            chunk = request.prompt_ids[request.fed:request.fed + budget]
            budget -= chunk.numel()
            n = chunk.numel()
            plan.append((request, Block(request.slot, chunk, torch.arange(request.fed, request.fed + n),
                                        causal_allowed(n), last_only=True), None))
        share = self.budget.per_slot(len(decoding))          # rows a slot's tree may have, root included
        turn = self.rounds % len(decoding) if decoding else 0
        rows = sum(block.tokens.numel() for _, block, _ in plan)
        tokens = 0.0                                         # expected tokens of the trees planned so far
        for k, request in enumerate(decoding[turn:] + decoding[:turn]):
            remaining = request.cfg.max_new_tokens - len(request.emitted.tokens)
            later = len(decoding) - k - 1                    # roots still to come: a row and a token each
            try:
                proposal = request.proposer.propose(request.sequence, remaining, request.cfg.sampling, request.gen,
                                                    request.proc, request.noise, context_nodes=share - 1,
                                                    beside=(rows + later, tokens + later))
            except Exception as exc:
                self._fail(request, exc)
                failed.append(request)
                continue
            tree = proposal.grown.tree
            rows += tree.size
            tokens += proposal.expected
            prefix = self.cache.lengths[request.slot]
            plan.append((request, Block(request.slot, tree.tokens, tree.positions(prefix), tree.mask()), proposal))
        return plan

    def _prefilled(self, request: Request, block: Block, logits: torch.Tensor, forward_s: float) -> None:
        """A prompt chunk fed; after the last one the target chooses the first token (as alone)."""
        request.fed += block.tokens.numel()
        request.stats.prefill_s += forward_s
        if request.fed < request.prompt_ids.numel():
            return
        prompt, cfg = request.prompt_ids, request.cfg
        request.stats.target_forwards += 1                       # the prompt's, as alone: one
        request.proposer.start(prompt, logits, None)
        scores = logits[-1] if request.proc is None else request.proc.at_prefix(prompt, logits[-1])
        root, lp = choose(scores, cfg.sampling, request.gen, cfg.return_logprobs, request.noise, prompt.numel())
        request.sequence = torch.cat([prompt, root.reshape(1)])
        request.new = request.emitted.add([int(root)], lp)

    def _accept(self, request: Request, proposal: Proposal, logits: torch.Tensor, draft_s: float,
                verify_s: float) -> None:
        """Judge the slot's tree as the lone round does, keep its path in the slot's cache, emit."""
        prefix = self.cache.lengths[request.slot] - proposal.grown.tree.size
        proposer = request.proposer
        verdict = judge(proposal.grown, request.sequence, logits, request.cfg, request.gen, proposer.policy,
                        context=proposer.context, proc=request.proc, noise=request.noise)
        self.cache.commit(request.slot, prefix, verdict.kept)
        proposer.observe(proposal, verdict.acc, None, verdict.last, draft_s * 1000, verify_s * 1000)
        stats = request.stats
        stats.target_forwards += 1
        stats.draft_s += draft_s
        stats.verify_s += verify_s
        stats.record_round(proposal.grown.tree, verdict.acc.n_accepted)
        new = proposal.emitted(verdict.acc, lossy=False)
        request.sequence = torch.cat([request.sequence, new])
        request.new = request.emitted.add(new.tolist(), verdict.emitted_lp)

    def _fail(self, request: Request, exc: Exception) -> None:
        request.error = exc
        self._leave(request)

    def _finish(self, request: Request) -> None:
        request.proposer.record(request.stats)
        request.stats.wall_s = time.perf_counter() - request.t_start
        request.output = request.emitted.output(request.stats)
        self._leave(request)

    def _leave(self, request: Request) -> None:
        """The request gives up its slot (and the slot's cache) for the next round's admission."""
        self.slots[request.slot] = None
        self.cache.free(request.slot)
        request.slot = None
