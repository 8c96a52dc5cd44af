"""PEARL: the draft and the target run at the same time (pre-verify and post-verify), exactly.

Paper: Liu et al., "PEARL: Parallel Speculative Decoding with Adaptive Draft
Length" (arXiv 2408.11850). Two ideas remove the mutual waiting of chain
speculative decoding:

- pre-verify: while the draft writes tokens 2..g, the target already scores
  the first one (a one-token forward on the round's root), so a wrong first
  token is caught before the draft's remaining work is waited for;
- post-verify: while the target verifies a chain, the draft goes on writing
  the next chain as if every token were accepted; when they all are, the
  next round's tokens are ready, and its first token is checked against the
  target's distribution after the chain (already computed) without any new
  forward.

The draft window g (`--tree` as a chain: "1,1,1,1" is g = 4, the default)
is, in the paper, about the target / draft step-time ratio.

Here the draft runs in a Python thread (torch releases the interpreter lock
inside its kernels) and the target in the calling thread. Select it with
`TreeDecoder(..., policy="pearl")` or `mcsd-generate --policy pearl`; options
`pre_verify` / `post_verify` (both on) through `policy_options`.

Exactness: every draft token is accepted or replaced by the target's own
rule (greedy: the target's argmax; sampling: accept x with min(1, p(x)/q(x)),
else draw from normalise(max(p - q, 0))), one position at a time, in order;
what ran concurrently only decides *when* a check happens, never its outcome.
No bonus token is drawn: after a fully accepted chain the next position is
decided by checking the draft's next token against the target's
distribution there, which is the same rule.

Limitations: chains only (no trees); a standalone draft model only (the
feature drafter needs the target's features of verified tokens, so it cannot
run ahead of verification); one sequence; `on_round` is not called. On a
CPU both threads compete for the same cores: what the draft computes
concurrently slows the target's forward, and pre-verify adds a target
forward per round, so PEARL needs spare parallel hardware (a GPU next to a
draft on other cores, or two devices) to pay; see the README's figures.
Seeded sampling is reproducible: each draft job draws from its own
generator seeded from the run's seed and the job's index.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Iterator

import torch

from ..config import ConfigError, DecodeConfig, SamplingConfig
from ..core.output import Emission, GenerationStats, eos_ids
from ..core.sampling import logits_to_probs, make_generator, sample
from ..core.tree import TreeTopology
from ..core.verify import normalise
from ..forward import kv_cache
from .draft import ModelDrafter
from .policies import register_policy
from .policies.base import TreePolicy


@register_policy
class PearlMode(TreePolicy):
    """Marks a decoder as running PEARL; its topology must be a chain (the draft window).

    Args:
        topology: a chain of g levels ("1,1,1,1"): the draft window.
        pre_verify: the target scores the first draft token while the draft writes the rest.
        post_verify: the draft writes the next chain while the target verifies.
    """

    name = "pearl"
    default_tree = "1,1,1,1"

    def __init__(self, topology: TreeTopology, pre_verify: bool = True, post_verify: bool = True):
        super().__init__(topology)
        if topology.max_depth < 1 or topology.size - 1 != topology.max_depth:
            raise ConfigError(f"PEARL drafts chains: give --tree as 1,1,...,1 (the draft window), not a tree of "
                              f"{topology.size - 1} nodes and depth {topology.max_depth}")
        for flag, value in (("pre_verify", pre_verify), ("post_verify", post_verify)):
            if not isinstance(value, bool):
                raise ConfigError(f"PEARL's {flag} must be True or False, got {value!r}")
        self.window = topology.max_depth
        self.pre_verify, self.post_verify = pre_verify, post_verify

    def bind_drafter(self, drafter) -> None:
        if not isinstance(drafter, ModelDrafter):
            raise ConfigError("PEARL runs a standalone draft model next to the target; this drafter "
                              f"({type(drafter).__name__}) cannot run ahead of verification (use --drafter model)")


class _DraftJob:
    """One chain of draft tokens written in a background thread, one token at a time, cancellable.

    The draft first reads `pending` (tokens it has not seen), then writes up to `n` tokens, reading
    each one but the last. `tokens` yields (token, q row or None) as they come; `processed` lists what
    entered the draft's cache.
    """

    def __init__(self, lm, pending: list[int], n: int, sampling: SamplingConfig, gen: torch.Generator | None):
        self.lm, self.pending, self.n, self.sampling, self.gen = lm, pending, n, sampling, gen
        self.tokens: queue.Queue = queue.Queue()
        self.cancel = threading.Event()
        self.processed: list[int] = []
        self.forwards = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                logits = self.lm.extend(torch.tensor(self.pending, device=self.lm.device),
                                        last_logits=True)[-1]                                   # (V,)
                self.processed.extend(self.pending)
                self.forwards += 1
                for i in range(self.n):
                    if self.cancel.is_set():
                        break
                    if self.sampling.greedy:
                        tok, q = int(logits.argmax()), None
                    else:
                        q = logits_to_probs(logits, self.sampling)                               # (V,)
                        tok = int(sample(q, self.gen))
                    self.tokens.put((tok, q))
                    if i + 1 == self.n or self.cancel.is_set():
                        break
                    logits = self.lm.extend(torch.tensor([tok], device=self.lm.device))[-1]
                    self.processed.append(tok)
                    self.forwards += 1
        except BaseException as exc:          # surfaced in the calling thread by next()/join()
            self.error = exc
        finally:
            self.tokens.put(None)

    def next(self):
        """The next (token, q) pair, or None once the job has stopped."""
        item = self.tokens.get()
        if item is None:
            self.tokens.put(None)             # later calls see the end too
            if self.error is not None:
                raise self.error
        return item

    def take(self, k: int) -> list:
        out = []
        while len(out) < k:
            item = self.next()
            if item is None:
                break
            out.append(item)
        return out

    def stop(self) -> None:
        self.cancel.set()
        self.thread.join()
        if self.error is not None:
            raise self.error


def _check(p: torch.Tensor, token: int, q: torch.Tensor | None, greedy: bool, gen) -> int | None:
    """The target's rule at one position. p: (V,) target probabilities (greedy: logits); q: (V,) draft
    probabilities the token was drawn from. Returns None if the token is accepted, else the replacement."""
    if greedy:
        best = int(p.argmax())
        return None if best == token else best
    q = q.to(p.device)
    u = torch.rand((), generator=gen, device=p.device)
    if bool(u * q[token] < p[token]):
        return None
    return int(sample(normalise(torch.clamp(p - q, min=0.0), fallback=p), gen))


def decode(dec, prompt_ids: torch.Tensor, cfg: DecodeConfig, mode: PearlMode,
           drafter: ModelDrafter) -> Iterator[list[int]]:
    """The PEARL loop for `TreeDecoder` (same output type and stop rules as its own loop).

    Invariant at the top of each round: `seq` holds the prompt and every emitted token; the target's
    cache holds all of `seq` (`root_cached`, with `root_probs` its distribution after `seq[-1]`) or all
    but its last token; a draft job, if running, continues `seq`.

    Args:
        dec: the TreeDecoder (its target and tokenizer are used).
        prompt_ids: (T,) long prompt.
        cfg: decoding settings.
        mode: the PEARL settings (window, pre/post-verify).
        drafter: the standalone draft.
    Yields each emission's new tokens; returns the GenerationOutput.
    """
    stats, sampling, window = GenerationStats(), cfg.sampling, mode.window
    gen = make_generator(cfg.seed, dec.target.device)
    base_seed = cfg.seed if cfg.seed is not None else int(torch.randint(0, 2**62, (1,), generator=gen))
    n_jobs = 0
    target, draft = dec.target, drafter.lm
    emitted = Emission(cfg, eos_ids(cfg, target.model, dec.tokenizer), dec.tokenizer)
    t_start = time.perf_counter()
    target.reset()
    draft.reset()
    drafter.forwards = 0
    held: list[int] = []                       # the tokens in the draft's cache
    probs = (lambda x: x.float()) if sampling.greedy else (lambda x: logits_to_probs(x, sampling))

    def start_job(speculative: list[int]) -> _DraftJob:
        """A job continuing `speculative` (seq, plus chain tokens assumed accepted)."""
        nonlocal n_jobs
        n_jobs += 1
        g = None if sampling.greedy else make_generator((base_seed * 1_000_003 + n_jobs) % 2**63, draft.device)
        budget = cfg.max_new_tokens - (len(speculative) - prompt_ids.numel())
        return _DraftJob(draft, speculative[len(held):], min(window, max(1, budget)), sampling, g)

    def absorb(job: _DraftJob | None, committed: list[int] | None = None) -> None:
        """Wait for a job (cancelled first when `committed` is given); with `committed`, then cut the
        draft's cache back to the longest prefix it shares with `committed`."""
        if job is not None:
            if committed is not None:
                job.stop()
            else:
                job.thread.join()
            held.extend(job.processed)
            drafter.forwards += job.forwards
        if committed is not None:
            keep = 0
            while keep < min(len(held), len(committed)) and held[keep] == committed[keep]:
                keep += 1
            keep = min(keep, len(committed) - 1)   # the last committed token is read again for its logits
            del held[keep:]
            kv_cache.truncate(draft.cache, keep)

    # Prefill: the target reads the prompt and knows its distribution after the last prompt token.
    seq = prompt_ids.tolist()
    job = start_job(seq)                       # the draft reads the prompt while the target does
    with torch.inference_mode():
        root_probs = probs(target.extend(prompt_ids, last_logits=True)[-1])                  # (V,)
    root_cached = True
    stats.target_forwards += 1
    stats.prefill_s = time.perf_counter() - t_start

    while emitted.finish is None:
        if job is None:
            job = start_job(seq)
        t0 = time.perf_counter()
        if not root_cached and mode.pre_verify:
            with torch.inference_mode():       # pre-verify: score the root while the draft writes
                root_probs = probs(target.extend(torch.tensor(seq[-1:], device=target.device))[-1])
            stats.target_forwards += 1
            root_cached = True
        t1 = time.perf_counter()
        stats.verify_s += t1 - t0
        if root_cached:
            # 1. the first draft token against the distribution already known: no forward needed
            token, q = job.take(1)[0]
            stats.draft_s += time.perf_counter() - t1
            fix = _check(root_probs, token, q, sampling.greedy, gen)
            new = [token if fix is None else fix]
            seq.extend(new)
            fresh = emitted.add(new)
            if fix is not None or emitted.finish is not None:
                stats.rounds += 1
                stats.accepted_per_round.append(0 if fix is not None else 1)
                absorb(job, seq)
                job, root_cached = None, False
                yield fresh
                continue
            yield fresh
            t1 = time.perf_counter()
            chain = job.take(window - 1)       # the rest, checked by the target's next forward
        else:
            chain = job.take(window)
        absorb(job)                            # this chain is written
        stats.draft_s += time.perf_counter() - t1
        feed = seq[-1:] + [t for t, _ in chain]                # seq[-1] is not in the target's cache
        # 2. post-verify: the draft writes the next chain while the target verifies this one
        job = start_job(seq + feed[1:]) if mode.post_verify else None
        t2 = time.perf_counter()
        with torch.inference_mode():
            rows = probs(target.extend(torch.tensor(feed, device=target.device)))          # (len(feed), V)
        stats.target_forwards += 1
        stats.verify_s += time.perf_counter() - t2
        new, fix = [], None
        best = rows[:len(chain)].argmax(-1).tolist() if sampling.greedy else None    # one host copy a round
        for i, (token, q) in enumerate(chain):
            if best is not None:
                fix = None if best[i] == token else best[i]
            else:
                fix = _check(rows[i], token, q, False, gen)
            if fix is not None:
                break
            new.append(token)
        stats.rounds += 1
        stats.accepted_per_round.append(len(new) + (1 if root_cached else 0))
        prefix = len(seq) - 1
        if fix is None:                        # all accepted: the next root is cached, its distribution known
            root_probs, root_cached = rows[len(chain)], True
        else:
            kv_cache.truncate(target.cache, prefix + 1 + len(new))
            new.append(fix)
            root_cached = False
        seq.extend(new)
        fresh = emitted.add(new)
        if fix is not None or emitted.finish is not None or job is None:
            absorb(job, seq)
            job = None
        yield fresh

    absorb(job, seq)
    stats.draft_forwards = drafter.forwards
    stats.wall_s = time.perf_counter() - t_start
    return emitted.output(stats)
