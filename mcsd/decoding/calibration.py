"""A decoder's view of this machine: the cost profile of its target and drafter, the costs a policy
or context drafting prices trees with, and the matmul path each forward runs on.

The profile is looked up once per decoder, while it is built (measured when none is cached,
see `mcsd.costs.store`); when the rounds of a generation find it stale, the cached profile is
flagged and measured again by the next decoder built on a quiet machine, or when the caller asks
(`TreeDecoder.recalibrate`), never inside a generation.
"""

from __future__ import annotations

import torch

from ..costs import cost_model, profile, store, timing
from ..drafting.policies import POLICIES
from ..forward import kernels, native, quant
from ..forward.lm import CachedLM


class Calibration:
    """Costs and kernel tables for one decoder's target and drafter.

    Args:
        target: the decoder's CachedLM.
        drafter: its model drafter (run on the measured matmul paths where it has `kernels`), or None.
        draft: the draft as given (a causal LM or a Drafter): what the profile is measured with.
        calibrate: None (default): the cached profile, measured when missing or stale on a quiet
            machine; True: measure again; False: never measure (cached profile, else generic costs).
        release_weights: where every block runs on prepacked weights, let the models' plain weights go
            for the copies (`mcsd.forward.kernels.pack`); only for models nothing else uses.

    Attributes:
        source: where the costs in use came from ("cached", "measured", "default"), or None when
            nothing prices trees.
        seconds: time spent measuring in this run.
        note: "; provisional: ..." when a measurement was taken on a busy machine, a note when it
            confirmed a profile flagged stale (`store.settle`), else None.
        kernels_note: which matmul path small blocks run on, or None.
    """

    def __init__(self, target: CachedLM, drafter, draft, calibrate: bool | None = None,
                 release_weights: bool = False):
        self.target, self.drafter, self.draft, self.calibrate = target, drafter, draft, calibrate
        self.release_weights = release_weights
        self.source, self.seconds, self.note, self.kernels_note = None, 0.0, None, None
        self._fetched: tuple | None = None

    def timed_draft(self):
        """The draft the profile times (a causal LM or a feature drafter), else None."""
        return _timed(self.draft)

    def profile(self):
        """This machine's profile for the pair, looked up (or measured) once; None where there is none."""
        if self._fetched is None:
            prof, source = device_profile(self.target.model, self.draft, self.calibrate)
            self._fetched = (_held_once(prof), source)
            self._note(*self._fetched)
        return self._fetched[0]

    def costs(self) -> cost_model.Costs:
        """Costs from this machine's profile; a stale verdict flags the cached profile for measuring again."""
        self.profile()
        costs = costs_of(*self._fetched)
        costs.on_stale = _stale_marker(self.target.model, self.draft, costs)
        self.source = costs.source
        return costs

    def policy_options(self, policy, options: dict | None) -> dict:
        """`options` for `make_policy`, with this machine's costs where the named policy prices its trees
        with them and none were given."""
        options = dict(options or {})
        if isinstance(policy, str) and getattr(POLICIES.get(policy), "uses_device_profile", False) \
                and "costs" not in options:
            options["costs"] = self.costs()
        if "costs" in options:
            self.source = options["costs"].source
        return options

    def choose_kernels(self, target_alone: bool) -> None:
        """Set each forward's matmul path from the profile, where the paths differ for this dtype."""
        self.kernels_note = self._q4_note()
        if kernels.packable(self.target.dtype, self.target.device):
            # the target alone needs only its paths: from any cached profile of it, never measured
            alone = target_alone and not self.calibrate
            self.use_kernels(_held_once(store.load_target_costs(self.target.model), alone=True) if alone
                             else self.profile())

    def _q4_note(self) -> str | None:
        model = self.target.model
        n, joined = quant.attached(model), quant.joined(model)
        dense = quant.starts_dense(quant.PREFILL_ROWS, cached=0)      # a prompt's first forward, here
        head = getattr(model, "get_output_embeddings", lambda: None)()
        on_q8 = ", the LM head on its Q8_0 codes" if head is not None and quant.code_bits(head) == 8 else ""
        on8 = f" on 8-bit activations ({native.int8_isa()} integer products)" \
            if quant.on_8bit_activations(model) else ""
        return (f"target: {n} linear layers on q4 weights{on8} ({quant.describe_kernel()}{on_q8}) at every block size"
                + ((", q / k / v and gate / up as one product each" if quant.kernel_name() == "native"
                    else ", q / k / v as one product") if joined else "")
                + (f", a prompt of {quant.PREFILL_ROWS}+ tokens read on the dense weights" if dense else "")) \
            if n else None

    def use_kernels(self, prof) -> None:
        """Run each forward on the matmul path the profile measured faster for its size."""
        if prof is None:
            return
        q8 = getattr(self.drafter, "q8_layers", 0)
        q4_note = self._q4_note()
        notes = [q4_note] if q4_note else []
        runners = [("target", "verify", self.target, self.target.model)]
        if self.drafter is not None and hasattr(self.drafter, "kernels"):
            runners.append(("draft", "draft", self.drafter, profile.drafter_module(self.drafter)))
        for label, role, runner, module in runners:
            table = prof.kernel_table(role)
            if label == "draft" and q8:
                notes.append(f"draft: {q8} linear layers on Q8_0 codes of its weights (mcsd's native kernel) "
                             f"at every block size")
            rest = (label == "target" and q4_note) or (label == "draft" and q8)
            if table is not None and rest and module is not None and not kernels.governed(module):
                table = None           # every linear layer runs on its codes: no path to switch a forward
            runner.kernels = table
            if table is None:
                continue
            notes.append(f"{label}{' (the rest)' if rest else ''}: {table.describe()}")
            if table.uses_packed and module is not None:       # prepacked weights are made once, here
                kernels.pack(module, release=table.packed_only and self.release_weights)
                if kernels.joined(module):
                    notes[-1] += " (q / k / v as one product)"
                if kernels.released(module):
                    notes[-1] += ", its plain weights let go"
        self.kernels_note = "; ".join(notes) or None

    def remeasure(self, costs: cost_model.Costs | None, force: bool = False) -> bool:
        """Measure again where a generation found the profile stale and the machine is quiet (or
        always with `force`), and run the next generations on the new kernel paths and costs. `costs`
        is updated in place (the policy and context drafting share it). Returns whether it measured."""
        if not force and (costs is None or costs.stale is None or not timing.quiet_now()):
            return False
        prof, source = device_profile(self.target.model, self.draft, calibrate=True)
        prof = _held_once(prof)
        self._note(prof, source)
        self._fetched = (prof, source)
        if costs is not None:
            costs.rebase(costs_of(prof, source))
            self.source = source
        if kernels.packable(self.target.dtype, self.target.device):
            self.use_kernels(prof)
        return True

    def _note(self, prof, source: str) -> None:
        """Remember what measuring cost this run and whether it was provisional, for --stats."""
        if prof is None or source != "measured":
            return
        self.seconds += prof.meta.get("calibration_s", 0.0)
        if prof.meta.get("provisional"):
            self.note = f"; provisional: {prof.meta['provisional']}"
        elif prof.meta.get("confirmed"):
            self.note = (f"; the cached costs, flagged stale, were confirmed (within "
                         f"{prof.meta['confirmed']['largest_ratio'] - 1:.0%}) and stay")


def _held_once(prof, alone: bool = False):
    """`prof` with each model's weights on one layout (`DeviceProfile.hold_once`), chosen for the
    blocks it runs: a target alone steps one row at a time; a target verifies trees of up to
    `ATEN_MAX_ROWS` nodes; a draft runs levels of every width it was timed at."""
    if prof is None:
        return None
    trees = tuple(n for n in prof.verify_ms if n <= timing.ATEN_MAX_ROWS)
    return prof.hold_once({"verify": (1,) if alone else trees, "draft": tuple(prof.draft_ms)})


def _timed(draft):
    """The draft a profile times: a causal LM or a drafter reading the target's hidden states, else None."""
    return draft if isinstance(draft, torch.nn.Module) or getattr(draft, "uses_target_hidden", False) else None


def _stale_marker(target, draft, costs):
    """on_stale for Costs: flag the cached profile so that the next start measures again."""
    return lambda reason: store.mark_stale(target, _timed(draft), reason, ratio=costs.stale_ratio)


def device_profile(target, draft, calibrate: bool | None = None) -> tuple:
    """(this machine's profile for the pair or None, where it came from): the cached one, measured when
    missing (or when `calibrate` is True); None with `calibrate=False` and nothing cached."""
    prof = None if calibrate else store.load_cached(target, _timed(draft), remeasure=calibrate is None)
    if prof is not None:
        return prof, "cached"
    if calibrate is False:
        return None, "default"
    return store.load_or_measure(target, _timed(draft), force=bool(calibrate)), "measured"


def costs_of(prof, source: str) -> cost_model.Costs:
    """Costs from a profile (see `device_profile`); generic defaults without one."""
    return cost_model.Costs.from_profile(prof, source=source) if prof is not None else cost_model.Costs.default()


def device_costs(target, draft, calibrate: bool | None = None) -> cost_model.Costs:
    """This machine's costs for the pair (see `device_profile`)."""
    return costs_of(*device_profile(target, draft, calibrate))
