"""The costs a tree policy reads: verify time by tree size and draft time by level width from a
measured profile, optionally corrected online, and the check that flags a profile gone stale.
"""

from __future__ import annotations

import contextlib
import copy

from ..forward.kernels import interpolate
from .profile import DeviceProfile

# ---------------------------------------------------------------------------- costs the policies use

STALE_RATIO = 1.3            # plain steps this much slower or faster than the profile, persistently: stale
STALE_ROUNDS = 8             # ... over this many plain (1-row) steps in a row (the median of them)
STALE_RATIO_ANY = 1.6        # rounds of any size, a looser bound (per-round work the profile leaves out)
STALE_ROUNDS_ANY = 24
# the profile times forwards over a cache of `prefix_len` positions; a step over a cache this many times
# longer or shorter reads that many more or fewer keys and values (on a 2-core EPYC a 135M target's
# step took 1.41x the profile's at 900-1000 positions, 0.99-1.08x at 0-300), which is not a change of
# machine: such steps are not checked against it
STALE_CONTEXT_SPAN = 2.0


class Costs:
    """Round costs in milliseconds: verify(n tree tokens) and one draft level of width w,
    from a measured profile, optionally corrected online by what rounds actually take.

    The correction (`online`) is a multiplicative factor per power-of-two size
    bucket, an exponentially weighted mean (weight `adapt`) of measured /
    predicted time; a bucket not yet seen uses the mean over all buckets. So a
    busy or throttled machine, a longer context or another prompt length
    moves the costs within a few rounds, while the measured shape (how verify
    grows with tree size) still orders sizes that have not been tried. It
    makes the costs, and so the trees a policy grows, depend on this run's
    timings; the learned policy leaves it off unless asked (`online_costs`).

    `round_ms`, `graft_ms`, `lookup_ms` and `context_round_ms` are what a drafted round, a context
    graft, a context lookup that finds nothing and a round of the root and its graft cost in decoding
    beyond the forwards the profile times (measured on the decoder's own rounds, fixed for a run).

    Whether or not it corrects, every observed verify round whose forward read a
    cache within `STALE_CONTEXT_SPAN` of the profile's `prefix_len` is checked against
    the profile: when the median of the last `STALE_ROUNDS` plain (1-row)
    steps is off by `STALE_RATIO` or more either way (or of the last
    `STALE_ROUNDS_ANY` rounds of any size by `STALE_RATIO_ANY`), the profile is
    stale: `stale` says why, and `on_stale(reason)` is called once (the decoder
    flags the cached profile for measuring again at the next start).
    """

    def __init__(self, verify: dict[int, float], draft: dict[int, float], source: str = "default",
                 adapt: float = 0.15, online: bool = False):
        self.verify, self.draft, self.source, self.adapt = dict(verify), dict(draft), source, adapt
        self.online = online
        # what decoding adds beyond the forwards (`mcsd.decoding.round_prices`), 0 until measured:
        self.round_ms = 0.0                         # a drafted round's drafting beyond its levels
        self.graft_ms = 0.0                         # a context graft's lookups and merge
        self.lookup_ms = 0.0                        # a context lookup that finds nothing
        self.context_round_ms = 0.0                 # a round of the root and its graft's own work
        self.prefix_len: int | None = None          # the cache the profile's forwards read (None: any)
        self.stale: str | None = None
        self.on_stale = None
        self.expected_ratio = 1.0                   # measured / profile that rounds are checked against
        self.stale_ratio: float | None = None       # measured / profile when flagged stale
        self._plain: list[float] = []               # measured / profile, last plain steps
        self._any: list[float] = []                 # the same, last rounds of any size
        self.reset_corrections()

    def rebase(self, other: "Costs") -> None:
        """Take `other`'s measured costs and source (a profile measured again), keeping this one's
        settings and hook; corrections and the staleness check start over."""
        self.verify, self.draft, self.source = dict(other.verify), dict(other.draft), other.source
        self.expected_ratio, self.stale_ratio, self.prefix_len = other.expected_ratio, None, other.prefix_len
        self.stale, self._plain, self._any = None, [], []
        self.reset_corrections()

    @contextlib.contextmanager
    def held(self):
        """Rounds observed meanwhile (a measurement's own) leave no trace: the corrections, the
        staleness windows and verdict as they were, and `on_stale` not called."""
        kept = {name: copy.deepcopy(getattr(self, name)) for name in
                ("stale", "stale_ratio", "_plain", "_any", "_factor", "_overall", "round_ms", "graft_ms",
                 "lookup_ms", "context_round_ms")}
        hook, self.on_stale = self.on_stale, None
        try:
            yield self
        finally:
            for name, value in kept.items():
                setattr(self, name, value)
            self.on_stale = hook

    def reset_corrections(self) -> None:
        self._factor = {"verify": {}, "draft": {}}
        self._overall = {"verify": 1.0, "draft": 1.0}

    @classmethod
    def default(cls) -> "Costs":
        # Shape measured for a 135M target on a 2-core CPU in bfloat16, in units of a 1-token verify;
        # only ratios matter to the policy. Used only when nothing can be measured.
        return cls(verify={1: 1.0, 8: 1.09, 16: 1.33, 32: 1.61, 64: 2.3}, draft={1: 0.1, 8: 0.13, 32: 0.2})

    @classmethod
    def from_profile(cls, profile: DeviceProfile, source: str = "measured") -> "Costs":
        """Costs on the faster matmul path per size, which is the one the engine runs."""
        costs = cls(verify=profile.best_ms("verify"), draft=profile.best_ms("draft") or cls.default().draft,
                    source=source)
        costs.prefix_len = profile.prefix_len
        observed = (profile.meta.get("confirmed") or {}).get("observed")
        if observed:                # a flag that measuring again did not confirm: that ratio is expected
            costs.expected_ratio = float(observed)
        return costs

    def _corr(self, kind: str, n: float) -> float:
        if not self.online:
            return 1.0
        return self._factor[kind].get(int(n).bit_length(), self._overall[kind])

    def base_verify_ms(self, n: int) -> float:
        return interpolate(self.verify, n)

    def base_draft_ms(self, width: int) -> float:
        return interpolate(self.draft, width)

    def verify_ms(self, n: int) -> float:
        return self.base_verify_ms(n) * self._corr("verify", n)

    def marginal_verify_ms(self, n: int) -> float:
        """The verify time one more node adds to an n-node tree: the measured shape's slope.
        Online corrections scale whole rounds, and much of what they absorb is per round (a
        longer context, hidden states, acceptance) rather than per node; scaling the slope
        with them priced context nodes at 1.3-1.4x what they cost (see README)."""
        return self.base_verify_ms(n + 1) - self.base_verify_ms(n)

    def draft_ms(self, width: int) -> float:
        return self.base_draft_ms(width) * self._corr("draft", width)

    def observe(self, kind: str, n: int | None, predicted_ms: float, measured_ms: float,
                forward_ms: float | None = None, context: int | None = None) -> None:
        """Fold one measured round into the correction (when `online`) and the staleness check:
        "verify" with n tree tokens, or "draft" with n None (a round's draft levels of several
        widths, corrected as a whole; predicted_ms is their uncorrected sum). `forward_ms`, the
        verify's target forward alone, is what the staleness check compares with the profile (which
        times forwards) where given: the sampling work around a sampled round's forward is not a
        change of machine. `context`, the cache positions the forward read, where known: a forward
        over a cache far longer or shorter than the profile's is not checked (`comparable`)."""
        if predicted_ms <= 0 or measured_ms <= 0:
            return
        ratio, a = measured_ms / predicted_ms, self.adapt
        if kind == "verify" and self.source != "default" and self.comparable(context):
            self._check_stale(n, forward_ms / predicted_ms if forward_ms else ratio)
        if not self.online:
            return
        if n is not None:
            bucket, b = self._factor[kind], int(n).bit_length()
            bucket[b] = (1 - a) * bucket.get(b, self._overall[kind]) + a * ratio
        self._overall[kind] = (1 - a) * self._overall[kind] + a * ratio

    def comparable(self, context: int | None) -> bool:
        """Whether a forward over a cache of `context` positions (None: unknown) is checked against the
        profile: within `STALE_CONTEXT_SPAN` of the cache its forwards read."""
        if context is None or not self.prefix_len:
            return True
        return self.prefix_len / STALE_CONTEXT_SPAN <= context <= self.prefix_len * STALE_CONTEXT_SPAN

    def _check_stale(self, n: int | None, ratio: float) -> None:
        self._slide(self._any, STALE_ROUNDS_ANY, STALE_RATIO_ANY, "rounds", ratio)
        if n == 1:
            self._slide(self._plain, STALE_ROUNDS, STALE_RATIO, "plain steps", ratio)

    def _slide(self, window: list[float], size: int, bound: float, what: str, ratio: float) -> None:
        """`ratio` into `window` (the last `size`), and the verdict on their median: stale when it is off
        both the profile's own figures and the ratio measuring again confirmed (a machine whose speed
        drifts between runs, a VM's, then moves between the two without measuring). Run every round,
        the plain steps included, so kept to a sort of the window and a few comparisons."""
        window.append(ratio)
        if len(window) > size:
            del window[0]
        if self.stale is not None or len(window) < size:
            return
        ordered = sorted(window)
        mid = (ordered[(size - 1) // 2] + ordered[size // 2]) / 2          # the median
        if 1 / bound < mid < bound or 1 / bound < mid / self.expected_ratio < bound:
            return
        self.stale_ratio = mid
        way = 'faster' if mid < self.expected_ratio else 'slower'
        self.stale = (f"the last {size} {what} took {mid:.2f}x the profile's time (measured {way}"
                      + (f" than the {self.expected_ratio:.2f}x expected)" if self.expected_ratio != 1 else ")"))
        if self.on_stale is not None:
            self.on_stale(self.stale)
