"""`BatchDecoder`: several requests decoded together, one target forward a round over every slot's rows.

A request takes a slot: its own cache length, positions, seed, generator, processors, proposer and
emission. Each round:
  0. admit: waiting requests join free slots at the round boundary, as many as there are free slots
     (a burst joins in one round and its prompts prefill together), the slots shared fairly between
     the requests' groups (a server's jobs: a job's runs take free slots after the groups holding
     fewer);
  1. propose: a prefilling slot offers its prompt's next chunk (all slots' chunks together under the
     round's prompt budget); a decoding slot its tree beneath its root (context drafting grafts
     branches where the decoder has it, at most the slot's share of the round's rows, which shrinks
     as slots join: `mcsd.decoding.row_budget`; otherwise the root alone, its last token);
  2. verify: one forward over every slot's rows, flat, each block under its own mask over its own slot
     (`mcsd.forward.slots`);
  3. accept and commit per slot, with the lone round's own judgement (`mcsd.decoding.accept`);
  4. emit: a finished request leaves its slot, free for the next round.

A request alone (admitted to an empty batch with nothing else waiting) runs the lone round instead,
on the decoder's own target cache: its model drafter (the feature head, a draft model) drafts the
decoder's trees and context drafting grafts beneath them, as `TreeDecoder.generate` does. When
another request joins, its cache moves into its slot and it goes on in the batched round, without
its model drafter (context drafting carries on).

What is the same as alone: greedy matching and the seeded Gumbel draw pick each token from the
target's own logits at that position, whatever was proposed, and the noise is keyed by the request's
seed and the token's position, never by the batch. So an answer is the lone run's wherever the
batched forward gives a row its lone logits:
- bit for bit on the native q4 and q4q8 layers (float32 activations; `mcsd.forward.slots`): there a
  batched answer is guaranteed the lone one;
- dense float32 (torch's products over all the round's rows): the last bits of a logit may differ
  (measured up to 6e-8 on the tests' tiny models), which has not changed a greedy token in the tests
  but could where two logits tie within it;
- bfloat16 and torch's int4 kernel: not guaranteed (bfloat16 rounds each product by its row count;
  an H200 run found 1-2 of 6 batched answers equal to their lone ones). On torch's int4 kernel the
  dense-or-4-bit choice is each prompt's, as its lone prefill makes it.
A request's `GenerationStats.batch_exact` says whether its answer is guaranteed (True) or not (False).
Rejection sampling ("rejection") is exact in distribution but, as alone, repeats a seed's text only
while the trees do.

Limitations: the target runs on the engine's own forward (a Llama-family model); beside other
requests a model drafter does not draft (their slots propose from context drafting where the decoder
has it, else decode plainly); lossy_target_roots is refused (not lossless). On CUDA the batched
round runs in fixed shapes, captured as CUDA graphs (`mcsd.forward.slots.SlotBlocks`): every slot,
each block padded to the round's bucket of rows; the lone round runs as the loop there (not the
fixed round of `--max-batch 1`).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from ..config import ConfigError, DecodeConfig, check_context_window
from ..core import processors
from ..core.output import Emission, GenerationOutput, GenerationStats, eos_ids
from ..core.sampling import PositionNoise, choose, make_generator
from ..core.verify import Acceptance
from ..drafting.context import ContextDrafter
from ..drafting.pearl import PearlMode
from ..drafting.policies import make_policy
from ..forward import graphs
from ..forward.attention import causal_allowed
from ..forward.slots import Block, SlotBlocks, SlotCache, SlotForward
from .accept import judge
from .propose import Proposal, Proposer
from .row_budget import RowBudget

PREFILL_TOKENS = 256            # prompt tokens a round feeds, over all prefilling slots together


class RequestFailed(RuntimeError):
    """`BatchDecoder.generate`: a prompt's request failed (its own part of a round raised). The message
    names the prompt and the failure; `__cause__` is the request's own exception.

    Attributes:
        index: the first failed prompt's place in the list.
        error: its exception.
        outputs: per prompt, its GenerationOutput, or the exception its request failed with.
    """

    def __init__(self, index: int, error: Exception, outputs: list):
        super().__init__(f"prompt {index} failed: {type(error).__name__}: {error}")
        self.index, self.error, self.outputs = index, error, outputs


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
        rows: rows it fed per batched round (its share of each round's forward).
        group: what it shares the slots with fairly (a server's job: its prompts and choices), or None
            (a group of its own).
        lone: it decodes alone, with the lone round on the decoder's own target cache.
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
    group: object = None
    lone: bool = False
    lone_policy_s: float = 0.0                    # the lone round's policy time, kept past the hand-over

    @property
    def done(self) -> bool:
        return self.output is not None or self.cancelled or self.error is not None


class BatchDecoder:
    """A `TreeDecoder`'s target, tokenizer and drafters, decoding up to `max_batch` requests together.

    Args:
        decoder: the `TreeDecoder` whose parts run (its target must run on the engine's own forward).
        max_batch: slots: requests decoded at once; more wait (first come, first served, the slots
            shared fairly between groups).
        prefill_tokens: prompt tokens a round feeds over all prefilling slots (a long prompt goes in
            chunks, so the others' rounds go on meanwhile).
        fixed_shapes: run the round in fixed shapes (`SlotBlocks`: every slot, blocks padded to
            buckets), captured as CUDA graphs where the decoder's target is on CUDA with graphs on; None
            (the default): on CUDA only. False: the flat batch of the blocks' own rows (`SlotForward`).
        lone_round: a request alone runs the lone round (its model drafter drafts; see the module's
            docstring); False: always the batched round. Only where the decoder has a model drafter.

    Attributes:
        rounds: batched forwards so far; last_rows: rows the last one fed; last_batch: slots it fed.
        cache: the slots' `SlotCache`, bounded by the context window (its `bound_bytes`).
        exact: the batched forward gives every row its lone logits bit for bit (native q4 layers).
    """

    def __init__(self, decoder, max_batch: int = 4, prefill_tokens: int = PREFILL_TOKENS,
                 fixed_shapes: bool | None = None, lone_round: bool = True):
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
        lone_rows = 1 + (decoder.context.config.max_nodes if decoder.context is not None else 0)
        # a slot holds at most the context window, and one block's rows after it (a tree, padding)
        window = decoder.context_window
        self.cache = SlotCache.for_model(lean, max_batch,
                                         None if window is None else window + max(graphs.BUCKETS[-1], lone_rows))
        self.budget = RowBudget(decoder.context_costs, lone_rows)     # trees sized by the load
        self.lone_round = bool(lone_round) and decoder.drafter is not None and \
            not isinstance(decoder.policy, PearlMode)
        self.vocab = target.model.get_input_embeddings().weight.shape[0]
        self.device = target.device
        self.waiting: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * max_batch
        self._ids = itertools.count()
        self.rounds, self.last_rows, self.last_batch = 0, 0, 0

    @property
    def exact(self) -> bool:
        return isinstance(self.forward, SlotForward) and self.forward.lean.native_layers() is not None

    # ------------------------------------------------------------------ requests

    def submit(self, prompt, max_new_tokens: int = processors.UNSET, temperature: float = processors.UNSET,
               top_k: int = processors.UNSET, top_p: float = processors.UNSET, seed: int | None = None,
               stop_strings=None, ignore_eos: bool = False, eos_token_ids=None, group=None,
               **options) -> Request:
        """Queue one prompt with `TreeDecoder.generate`'s options; it joins a slot at the next round
        with one free. `group`: what it shares the slots with fairly (requests of one group take free
        slots after groups holding fewer). A bad option is a ConfigError here, before anything runs."""
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
        request = Request(next(self._ids), prompt_ids, cfg, emitted, self._batched_proposer(context),
                          make_generator(cfg.seed, self.device), noise,
                          processors.build(cfg.processing, prompt_ids.numel(), emitted.eos), group=group)
        self.waiting.append(request)
        return request

    def _batched_proposer(self, context: ContextDrafter | None) -> Proposer:
        """A slot's proposer in the batched round: the root, context drafting grafting beneath it."""
        policy = make_policy("static", "")
        policy.topology = policy.topology.to(self.device)
        return Proposer(policy, None, context, 0, self.decoder.context_costs)

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
        the prompts' order, each what `TreeDecoder.generate` gives that prompt alone.

        Raises:
            RequestFailed: a prompt's request failed (the others were decoded: its `outputs`), with
                that request's message; an exception of the shared forward as it is (every request
                of the call cancelled).
        """
        requests = []
        try:
            requests = [self.submit(p, **options) for p in prompts]
            while not all(r.done for r in requests):
                self.step()
        except BaseException:
            for r in requests:
                if not r.done:
                    self.cancel(r)
            raise
        failed = [i for i, r in enumerate(requests) if r.error is not None]
        if failed:
            error = requests[failed[0]].error
            raise RequestFailed(failed[0], error, [r.output if r.error is None else r.error
                                                   for r in requests]) from error
        return [r.output for r in requests]

    # ------------------------------------------------------------------ the round

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """One round over every slot. Returns the requests it advanced (their `new` tokens; `output`
        set on those that finished, `error` on those that failed; both have left their slots). An
        exception in the forward itself, which all share, is raised (the slots' states are then unknown:
        `cancel` every active request)."""
        failed = self._admit()                                           # 0. join at the round boundary
        alone = self._alone()
        if alone is not None:
            return failed + self._lone_step(alone)
        self.last_rows = self.last_batch = 0
        plan = self._propose(failed)                                     # 1. every slot's rows
        if not plan:
            return failed
        t1 = time.perf_counter()
        logits = self.forward(self.cache, [block for _, block, _, _ in plan])   # 2. one forward, flat
        verify_s = time.perf_counter() - t1
        self.rounds += 1
        self.last_rows, self.last_batch = sum(b.tokens.numel() for _, b, _, _ in plan), len(plan)
        exact = self.exact
        advanced = failed
        for (request, block, proposal, draft_s), rows in zip(plan, logits):   # 3-4. per slot
            try:
                request.rows.append(block.tokens.numel())
                request.stats.record_batch(block.tokens.numel(), self.last_rows, self.last_batch)
                request.stats.batch_exact = exact and request.stats.batch_exact is not False
                if proposal is None:
                    self._prefilled(request, block, rows, verify_s)
                else:
                    self._accept(request, proposal, rows, draft_s, verify_s)
                if request.emitted.finish is not None:
                    self._finish(request)
            except Exception as exc:                                     # this request fails alone
                self._fail(request, exc)
                advanced.append(request)
                continue
            if request.sequence is not None:
                advanced.append(request)
        return advanced

    def _admit(self) -> list[Request]:
        """Waiting requests into the free slots (as many as there are), the group holding the fewest
        slots first, in arrival order within a group; a request admitted to an empty batch with nothing
        else waiting decodes alone, and a lone request hands its cache over to its slot when another
        joins. Returns the requests whose start failed (they alone fail)."""
        free = [slot for slot, held in enumerate(self.slots) if held is None]
        failed: list[Request] = []
        if not free or not self.waiting:
            return failed
        alone = self._alone()
        if alone is not None:
            try:
                self._hand_over(alone)                   # company: it goes on in its slot, batched
            except Exception as exc:
                self._fail(alone, exc)
                failed.append(alone)
        elif self.lone_round and not self.active and len(self.waiting) == 1:
            self._take(self.waiting.popleft(), free[0], failed, lone=True)
            return failed
        held = Counter(_group(r) for r in self.active)
        for slot in free:
            if not self.waiting:
                break
            request = min(self.waiting, key=lambda r: held[_group(r)])   # the first of the fewest held
            self.waiting.remove(request)
            held[_group(request)] += 1
            self._take(request, slot, failed)
        return failed

    def _take(self, request: Request, slot: int, failed: list[Request], lone: bool = False) -> None:
        request.slot, request.t_start = slot, time.perf_counter()
        self.slots[slot] = request
        self.cache.free(slot)
        try:
            if lone:                       # the lone round's proposer: the decoder's policy and drafter
                dec = self.decoder
                if dec.fixed_round is not None:
                    dec.fixed_round.release()      # the lone round runs as the loop (its target's blocks as before)
                request.proposer = Proposer(dec.policy, dec.drafter, request.proposer.context, 0, dec.context_costs)
                request.lone = True
                request.stats.round_reason = "alone: the lone round"
            else:
                request.proposer.reset()
                request.stats.round_reason = "batched"
        except Exception as exc:
            self._fail(request, exc)
            failed.append(request)

    def _alone(self) -> Request | None:
        """The request decoding alone with the lone round, if there is one."""
        active = self.active
        return active[0] if len(active) == 1 and active[0].lone else None

    def _propose(self, failed: list[Request]) -> list[tuple[Request, Block, Proposal | None, float]]:
        """Each active slot's block: a prompt chunk (None proposal) or its round's tree, with the seconds
        the slot's own proposal took; a request whose proposal raised goes to `failed` instead.

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
                                        causal_allowed(n), last_only=True, prompt_rows=total), None, 0.0))
        share = self.budget.per_slot(len(decoding))          # rows a slot's tree may have, root included
        turn = self.rounds % len(decoding) if decoding else 0
        rows = sum(block.tokens.numel() for _, block, _, _ in plan)
        tokens = 0.0                                         # expected tokens of the trees planned so far
        for k, request in enumerate(decoding[turn:] + decoding[:turn]):
            remaining = request.cfg.max_new_tokens - len(request.emitted.tokens)
            later = len(decoding) - k - 1                    # roots still to come: a row and a token each
            t0 = time.perf_counter()
            try:
                proposal = request.proposer.propose(request.sequence, remaining, request.cfg.sampling, request.gen,
                                                    request.proc, request.noise, context_nodes=share - 1,
                                                    beside=(rows + later, tokens + later))
            except Exception as exc:
                self._fail(request, exc)
                failed.append(request)
                continue
            draft_s = time.perf_counter() - t0               # this slot's own drafting, not the round's
            tree = proposal.grown.tree
            rows += tree.size
            tokens += proposal.expected
            prefix = self.cache.lengths[request.slot]
            plan.append((request, Block(request.slot, tree.tokens, tree.positions(prefix), tree.mask()), proposal,
                         draft_s))
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
                        context=proposer.context if proposer.recycles(proposal) else None, proc=request.proc,
                        noise=request.noise)
        self.cache.commit(request.slot, prefix, verdict.kept)
        proposer.observe(proposal, verdict.acc, None, verdict.last, draft_s * 1000, verify_s * 1000)
        self._emit(request, proposal, verdict.acc, verdict.emitted_lp, draft_s, verify_s)

    # ------------------------------------------------------------------ a request alone: the lone round

    def _lone_step(self, request: Request) -> list[Request]:
        """The lone round for the one request in the batch (the prefill first): `TreeDecoder`'s own
        parts on its target cache, its model drafter drafting. Returns [request] once it has a token."""
        request.new = []
        try:
            if request.sequence is None:
                self._lone_prefill(request)
            else:
                self._lone_round(request)
            if request.emitted.finish is not None:
                self._finish(request)
        except Exception as exc:                                         # it alone fails
            self._fail(request, exc)
        return [request] if request.sequence is not None or request.done else []

    def _lone_prefill(self, request: Request) -> None:
        """The decoder's own prefill (the whole prompt in one forward, as alone)."""
        dec, cfg = self.decoder, request.cfg
        t0 = time.perf_counter()
        sequence, new, lp = dec._prefill(request.prompt_ids, cfg, request.proposer, request.gen, request.proc,
                                         request.noise)
        request.stats.target_forwards += 1
        request.stats.prefill_s += time.perf_counter() - t0
        request.fed, request.sequence = request.prompt_ids.numel(), sequence
        request.new = request.emitted.add(new, lp)

    def _lone_round(self, request: Request) -> None:
        """The loop's own round (`TreeDecoder._round`) on the decoder's target cache."""
        cfg = request.cfg
        request.sequence, new, lp = self.decoder._round(request.sequence, cfg, request.gen, request.proposer,
                                                        request.proc, request.noise,
                                                        cfg.max_new_tokens - len(request.emitted.tokens),
                                                        request.stats)
        request.new = request.emitted.add(new, lp)

    def _hand_over(self, request: Request) -> None:
        """Another request joins: the lone request's cache moves into its slot and it goes on in the
        batched round (its model drafter stops; its context drafter carries on)."""
        lone = request.proposer
        lone.record(request.stats)                   # what its model drafter did while alone
        request.lone_policy_s = request.stats.policy_s
        if request.sequence is not None:
            target = self.decoder.target
            n = target.length
            self.cache.write(request.slot, target.cache.keys[:, 0, :, :n], target.cache.values[:, 0, :, :n])
        request.proposer = self._batched_proposer(lone.context)
        request.lone = False
        request.stats.round_reason = f"alone: the lone round, then batched from token {len(request.emitted.tokens)}"

    # ------------------------------------------------------------------ ends

    def _emit(self, request: Request, proposal: Proposal, acc: Acceptance, emitted_lp, draft_s: float,
              verify_s: float) -> None:
        """A round's accepted path and the target's next token, into the request's sequence and stats."""
        request.stats.record_round(proposal.grown.tree, acc.n_accepted, draft_s, verify_s)
        new = proposal.emitted(acc, lossy=False)
        request.sequence = torch.cat([request.sequence, new])
        request.new = request.emitted.add(new.tolist(), emitted_lp)

    def _fail(self, request: Request, exc: Exception) -> None:
        request.error = exc
        if request.slot is not None:
            self._leave(request)

    def _finish(self, request: Request) -> None:
        request.proposer.record(request.stats)
        request.stats.policy_s += request.lone_policy_s
        request.stats.wall_s = time.perf_counter() - request.t_start
        request.output = request.emitted.output(request.stats)
        self._leave(request)

    def _leave(self, request: Request) -> None:
        """The request gives up its slot (and the slot's cache) for the next round's admission."""
        self.slots[request.slot] = None
        self.cache.free(request.slot)
        request.slot = None
        request.lone = False


def _group(request: Request):
    """What a request shares the slots with: its group, else itself alone."""
    return request.group if request.group is not None else request
