"""The logits processors the server adds to a request: OpenAI's penalties, the target's top
log-probabilities, and the test-only faults.

Each runs where `mcsd.core.processors` runs every processor: on the target's (and the draft's) logits
at every tree node, with that node's own prefix (input ids (n, L), scores (n, V)). The penalties
treat each row on its own and keep no state, so decoding with them stays exact: greedy output is
what plain decoding with the same penalty gives. The recorder only reads the scores.
"""

from __future__ import annotations

import time

import torch

from ..config import SamplingConfig
from ..core.sampling import logits_to_probs

# What a log-probability of zero probability (a token top-p left out) is reported as: JSON has no -inf.
FLOOR = -9999.0


class Penalties:
    """OpenAI's `frequency_penalty` and `presence_penalty`: a token's logit drops by
    frequency x (its count in the completion so far) + presence x (1 if it occurs there at all).

    Only the completion counts (input ids past `prompt_len`), as in OpenAI's definition.

    Args:
        prompt_len: prompt tokens at the start of every row of input ids.
        frequency, presence: the penalties, in [-2, 2].
    """

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, float(frequency), float(presence)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        completion = input_ids[:, self.prompt_len:]                                   # (n, L - prompt_len)
        if completion.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add_(1, completion, torch.ones_like(completion, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence   # (n, V)


class TokenLogprobs:
    """Records the distribution each token is chosen from, so that a stream can report every round's
    log-probabilities (and the top alternatives) as the round ends.

    Put last in the processor list: it sees the processed scores, then applies the sampling warpers
    itself (temperature, top-p), as the decoder does before it chooses. Rows are keyed by the
    completion so far; the target's verify pass scores a prefix after any draft step that scored the
    same one, so the row kept is the target's. `take` reads the emitted tokens' rows and forgets the rest.

    Args:
        prompt_len: prompt tokens at the start of every row of input ids.
        sampling: the request's sampling settings (greedy: the log-softmax of the processed scores).
        top: how many alternatives to report per token (0: none).
    """

    def __init__(self, prompt_len: int, sampling: SamplingConfig, top: int):
        self.prompt_len, self.sampling, self.top = prompt_len, sampling, top
        self.rows: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.sampling.greedy:
            logp = scores.float().log_softmax(-1)                                     # (n, V)
        else:
            logp = logits_to_probs(scores, self.sampling).log()
        for row, key in enumerate(input_ids[:, self.prompt_len:].tolist()):
            self.rows[tuple(key)] = logp[row]
        return scores

    def take(self, completion: list[int], start: int) -> list[tuple[float, list[tuple[int, float]]]]:
        """(log-probability, [(token, log-probability)] of the `top` most likely) for each of
        completion[start:], the tokens emitted since the last call; forgets every row."""
        found = [self.rows.get(tuple(completion[:j])) for j in range(start, len(completion))]
        self.rows.clear()
        out: list[tuple[float, list[tuple[int, float]]]] = [(FLOOR, []) for _ in found]
        kept = [i for i, row in enumerate(found) if row is not None]   # all of them in the exact loop
        if not kept:
            return out
        logp = torch.stack([found[i] for i in kept])                                   # (k, V)
        chosen = torch.tensor([completion[start + i] for i in kept], device=logp.device)
        chosen_lp = logp.gather(1, chosen[:, None])[:, 0].tolist()                    # one host copy a round
        if self.top:
            values, ids = torch.topk(logp, self.top)                                   # (k, top)
            values, ids = values.tolist(), ids.tolist()
        for r, i in enumerate(kept):
            alternatives = [(a, _finite(v)) for a, v in zip(ids[r], values[r])] if self.top else []
            out[i] = (_finite(chosen_lp[r]), alternatives)
        return out


def _finite(value: float) -> float:
    return max(FLOOR, value)


# Test-only markers (`mcsd-serve --fault-injection`): a prompt holding one fails its generation, fails the
# reporting of its tokens (outside the decoder's round), or slows its generation.
FAULT_MARKER = "[[mcsd-fault]]"
REPORT_FAULT_MARKER = "[[mcsd-fault-report]]"
SLOW_MARKER = "[[mcsd-slow]]"


class InjectedFault(RuntimeError):
    """Raised inside a generation by `Fault`: what a test uses to check that one failing request
    leaves the server serving."""


class Fault:
    """Test-only (`mcsd-serve --fault-injection`): raises `InjectedFault` at its `after`-th call, from
    inside the decoder's loop."""

    def __init__(self, after: int = 3):
        self.calls, self.after = 0, after

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls >= self.after:
            raise InjectedFault("fault injected for a test (--fault-injection)")
        return scores


class Slow:
    """Test-only (`mcsd-serve --fault-injection`): sleeps `seconds` at every call, so that a tiny
    model's generation lasts long enough to be interrupted."""

    def __init__(self, seconds: float = 0.05):
        self.seconds = seconds

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return scores


class ReportFault(TokenLogprobs):
    """Test-only (`mcsd-serve --fault-injection`): a recorder whose `take` raises `InjectedFault`, so that
    the engine's reporting of a round's tokens fails (outside the decoder's round) for this request.
    As a processor it passes the scores through and keeps nothing."""

    def __init__(self):
        super().__init__(0, SamplingConfig(), 0)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores

    def take(self, completion: list[int], start: int):
        raise InjectedFault("fault injected while reporting tokens, for a test (--fault-injection)")
