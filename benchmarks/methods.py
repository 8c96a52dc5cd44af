"""The methods compared, as a registry of named runners.

A runner takes the session's `Bench` and one prompt's ids and returns a `Run`.
Static trees, chains and Hugging Face's settings are listed here; every tree
policy registered in `mcsd.drafting.policies.POLICIES` (other than "static") is added
automatically under "policy_<name>", with the policy's own `default_tree`, so
a new policy shows up in the comparison without editing this file. PEARL
("pearl", an execution mode registered like a policy) is listed on its own:
it runs the standalone draft model, as Hugging Face assisted generation does.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from llama_worker import LlamaCppWorker, Worker

from mcsd import TreeDecoder
from mcsd.drafting.policies import POLICIES
from mcsd.forward import kernels
from mcsd.forward.kv_cache import cache_keyword

CHAIN_KS = (1, 2, 3, 4, 6)
TREES = ("2,2,1", "4,2,2", "3,2,2,1")
HF_FIXED = (2, 4, 6)
HF_PROMPT_LOOKUP = (3, 5, 10)         # prompt_lookup_num_tokens; transformers' own default is 10


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    target_forwards: int
    draft_s: float = 0.0
    verify_s: float = 0.0
    policy_s: float = 0.0
    accepted_per_round: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)
    offered_by_depth: list[int] = field(default_factory=list)
    context_nodes: int = 0
    context_accepted: int = 0


@dataclass(frozen=True)
class Method:
    name: str
    family: str                       # baseline | hf_assisted | hf_prompt_lookup | chain | tree | policy | context | pearl | llama_cpp
    run: Callable[["object", torch.Tensor], Run]
    tree: str | None = None
    policy: str | None = None                  # tree policy name, checked before the run


@contextlib.contextmanager
def _count_forwards(model):
    """Count forward calls of `model` through a public forward pre-hook."""
    calls = [0]
    handle = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        yield calls
    finally:
        handle.remove()


@contextlib.contextmanager
def _assistant_settings(draft, **settings):
    """Temporarily change the assistant's generation config (what HF assisted generation reads)."""
    old = {k: getattr(draft.generation_config, k, None) for k in settings}
    for k, v in settings.items():
        setattr(draft.generation_config, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(draft.generation_config, k, v)


def _hf(bench, ids, assistant=False, onednn=True, **settings) -> Run:
    """Hugging Face `generate`, greedy or with the bench's sampling: `settings` go to the assistant's generation config with
    `assistant`, else to `generate` itself. `onednn=False` runs the whole call with torch's oneDNN
    matrix products off (ATen's kernels; see `mcsd.forward.kernels`), the best single setting for
    one-token steps in bfloat16 on a CPU with native bf16."""
    target = bench.target
    ids = ids.to(target.device)[None]
    kwargs = dict(max_new_tokens=bench.max_new_tokens, do_sample=bool(bench.sampling),
                  attention_mask=torch.ones_like(ids), pad_token_id=bench.tokenizer.eos_token_id, **bench.sampling)
    if bench.sampling:                                   # transformers samples from torch's global generator
        torch.manual_seed(bench.seed_for(ids[0]))
    if not assistant:
        kwargs.update(settings)
    ctx = _assistant_settings(bench.assistant, **settings) if assistant else contextlib.nullcontext()
    with ctx, kernels.onednn(onednn), _count_forwards(target) as calls, torch.inference_mode():
        t0 = time.perf_counter()
        out = target.generate(ids, assistant_model=bench.assistant if assistant else None, **kwargs)
        seconds = time.perf_counter() - t0
    return Run(out[0, ids.shape[1]:].tolist(), seconds, calls[0])


def _hf_static(bench, ids, compiled: bool) -> Run:
    """Hugging Face greedy `generate` with a pre-allocated static KV cache, eager or compiled
    (torch.compile, on every device). One cache length serves every prompt, so the compiled
    decoding step is built once; building it is warm-up, outside the timing."""
    from transformers import StaticCache
    from transformers.generation import CompileConfig
    length = -(-(max(p.numel() for _, p in bench.prompts) + bench.max_new_tokens) // 256) * 256

    def fresh_cache() -> dict:                   # by the keyword the model takes (`cache` in newer transformers)
        return {cache_keyword(bench.target): StaticCache(config=bench.target.config, max_cache_len=length)}

    settings = {"disable_compile": True}
    if compiled:
        cfg = CompileConfig(mode="default" if bench.target.device.type == "cpu" else "reduce-overhead")
        cfg._compile_all_devices = True                  # transformers compiles on accelerators only by default
        settings = {"compile_config": cfg}
        if not bench.decoders.get("hf_compiled_built"):
            _hf(bench, ids, **fresh_cache(), **settings)
            bench.decoders["hf_compiled_built"] = True
    return _hf(bench, ids, **fresh_cache(), **settings)


def _mcsd(bench, ids, tree: str | None, policy: str = "static", baseline: bool = False,
          drafter: str = "model", draft=None) -> Run:
    """An mcsd TreeDecoder run. drafter: "model" (`draft`, default the bench's draft: a draft LM or a
    feature head), "context" (context proposals alone) or "model+context" (both merged in one tree)."""
    draft = bench.draft if draft is None else draft
    key = (tree, policy, drafter, id(draft))
    dec = bench.decoders.get(key)
    if dec is None:
        chosen = {"model": draft, "context": "context", "model+context": [draft, "context"]}[drafter]
        dec = bench.decoders[key] = TreeDecoder(bench.target, chosen, tokenizer=bench.tokenizer, tree=tree,
                                                policy=policy, threads=None)    # the harness sets them
    gen = dec.generate_baseline if baseline else dec.generate
    sampling = {**bench.sampling, "seed": bench.seed_for(ids)} if bench.sampling else {}
    out = gen(ids, max_new_tokens=bench.max_new_tokens, **sampling)
    s = out.stats
    return Run(out.tokens, s.wall_s, s.target_forwards, s.draft_s, s.verify_s, s.policy_s, s.accepted_per_round,
               s.accepted_by_depth, s.offered_by_depth, s.context_nodes, s.context_accepted)


class _ShutGates(POLICIES["learned"]):
    """The learned policy with its gate shut for good: a gate that lost and waits longer than any
    generation before its next probe, so every round runs a shut gate's own path (no draft priced, a
    plain step through the round's machinery) and says so (`rounds_to_draft`): the steps take no target
    features for a draft that never comes, as a shut gate's steps far from its next probe take none."""

    def forget(self) -> None:
        super().forget()
        self.draft_value, self.gate.gap = -1.0, 2 ** 31


def _gates_shut(bench, ids) -> Run:
    """The default drafter under a policy that never drafts, context drafting left out: what the
    default's rounds cost when every gate is shut, against `baseline_mcsd`'s plain steps."""
    dec = bench.decoders.get("gates_shut")
    if dec is None:
        from mcsd.core.tree import TreeTopology
        dec = bench.decoders["gates_shut"] = TreeDecoder(
            bench.target, bench.draft, tokenizer=bench.tokenizer,
            policy=_ShutGates(TreeTopology.from_spec(POLICIES["learned"].default_tree)), threads=None)
    sampling = {**bench.sampling, "seed": bench.seed_for(ids)} if bench.sampling else {}
    out = dec.generate(ids, max_new_tokens=bench.max_new_tokens, **sampling)
    s = out.stats
    return Run(out.tokens, s.wall_s, s.target_forwards, s.draft_s, s.verify_s, s.policy_s, s.accepted_per_round,
               s.accepted_by_depth, s.offered_by_depth, s.context_nodes, s.context_accepted)


def llama_cpp_unavailable(bench) -> str | None:
    """Why llama.cpp cannot run the bench's target, or None: the `llama` extra (llama-cpp-python)
    must be installed and the target must be a preset, whose GGUF is what mcsd converted it from.
    Only looked up here: llama.cpp is never imported into the benchmark's own process."""
    if importlib.util.find_spec("llama_cpp") is None:
        return ("llama-cpp-python is not installed (python tools/build_llama_cpp.py, or pip install -e '.[llama]'; "
                "it builds llama.cpp from source, about 30 minutes on 2 cores)")
    if bench.target_preset is None:
        return "llama.cpp runs a preset's GGUF; --bench-target is not a preset"
    if bench.device != "cpu":
        return "llama.cpp is compared on the CPU only"
    return None


# llama-cpp-python's advice for its prompt lookup: 2 draft tokens a step on a CPU (10 on a GPU)
LLAMA_LOOKUP_TOKENS = 2


def llama_cpp_worker(bench, lookup: int = 0) -> Worker:
    """The session's llama.cpp process (one per `lookup`: prompt-lookup draft tokens a step, 0 for
    none), started on first use with the preset's GGUF and torch's thread count, and warmed up on the
    first prompt (4 tokens), as the bench warms the target up, so no prompt's timing carries
    llama.cpp's first-call overheads. The bench closes it at the end."""
    name = f"llama_cpp_lookup{lookup}" if lookup else "llama_cpp"
    worker = bench.workers.get(name)
    if worker is None:
        from mcsd.loading.models import fetch_preset_gguf
        worker = bench.workers[name] = LlamaCppWorker(fetch_preset_gguf(bench.target_preset),
                                                      threads=torch.get_num_threads(), lookup=lookup)
        worker.generate(bench.prompts[0][1].tolist(), 4)
    return worker


def _llama_cpp(bench, ids, lookup: int = 0) -> Run:
    """llama.cpp on the GGUF the target was converted from, in its own process (`benchmarks/llama_worker.py`):
    greedy (top-1) or the bench's sampling, its prompt ids; prompt processing is timed, as the engine's
    prefill is. The seconds are the worker's own timing of the decoding, not the pipe's round trip.
    With `lookup`, llama-cpp-python's own prompt-lookup drafting (its forwards are not counted: tau
    is left at 1)."""
    sampling = bench.sampling
    stop = bench.tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokens, seconds = llama_cpp_worker(bench, lookup).generate(
        ids.tolist(), bench.max_new_tokens, temperature=sampling.get("temperature", 0.0),
        top_p=sampling.get("top_p", 1.0), seed=bench.seed_for(ids) if sampling else None,
        stop_ids=[stop] if isinstance(stop, int) else [])
    return Run(tokens, seconds, len(tokens))


def all_methods() -> list[Method]:
    """Every method, the reference ("baseline") first."""
    methods = [
        Method("baseline", "baseline", lambda b, ids: _hf(b, ids)),
        Method("baseline_mcsd", "baseline", lambda b, ids: _mcsd(b, ids, "", baseline=True)),
        Method("hf_aten", "baseline", lambda b, ids: _hf(b, ids, onednn=False)),
        Method("hf_static", "baseline", lambda b, ids: _hf_static(b, ids, compiled=False)),
        Method("hf_compiled", "baseline", lambda b, ids: _hf_static(b, ids, compiled=True)),
        # what TreeDecoder(target, draft, tokenizer=...) and mcsd-generate run when nothing is asked for
        Method("default", "policy", lambda b, ids: _mcsd(b, ids, None, "auto"), policy="auto"),
        # ... with every gate shut: its rounds are plain steps, to be set beside baseline_mcsd's
        Method("gates_shut", "baseline", _gates_shut),
        Method("hf_assisted", "hf_assisted", lambda b, ids: _hf(b, ids, assistant=True)),
        # another engine on the same weights' source (the preset's GGUF): where a CPU user compares
        Method("llama_cpp", "llama_cpp", _llama_cpp),
        # ... with its own prompt-lookup drafting, the closest it has to mcsd's context drafting
        Method("llama_cpp_lookup", "llama_cpp", lambda b, ids: _llama_cpp(b, ids, LLAMA_LOOKUP_TOKENS)),
    ]
    for n in HF_FIXED:
        methods.append(Method(f"hf_assisted_n{n}", "hf_assisted", lambda b, ids, n=n: _hf(
            b, ids, assistant=True, num_assistant_tokens=n, num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0)))
    for n in HF_PROMPT_LOOKUP:
        methods.append(Method(f"hf_prompt_lookup_n{n}", "hf_prompt_lookup",
                              lambda b, ids, n=n: _hf(b, ids, prompt_lookup_num_tokens=n)))
        methods.append(Method(f"hf_prompt_lookup_n{n}_aten", "hf_prompt_lookup",
                              lambda b, ids, n=n: _hf(b, ids, onednn=False, prompt_lookup_num_tokens=n)))
    # free proposals from the context: alone, and merged with the drafter under the default policy
    methods.append(Method("context", "context", lambda b, ids: _mcsd(b, ids, None, "auto", drafter="context"),
                          policy="auto"))
    methods.append(Method("default_context", "context",
                          lambda b, ids: _mcsd(b, ids, None, "auto", drafter="model+context"), policy="auto"))
    for k in CHAIN_KS:
        spec = ",".join(["1"] * k)
        methods.append(Method(f"chain_k{k}", "chain", lambda b, ids, s=spec: _mcsd(b, ids, s), tree=spec))
    for spec in TREES:
        methods.append(Method(f"tree_{spec.replace(',', '-')}", "tree", lambda b, ids, s=spec: _mcsd(b, ids, s),
                              tree=spec))
    # PEARL runs a standalone draft model next to the target (the preset's, as Hugging Face assisted
    # generation does, when the session's drafter is the feature head)
    pearl_tree = POLICIES["pearl"].default_tree
    methods.append(Method("pearl", "pearl", lambda b, ids: _mcsd(b, ids, pearl_tree, "pearl", draft=b.assistant),
                          tree=pearl_tree, policy="pearl"))
    for name, cls in sorted(POLICIES.items()):
        if name in ("static", "pearl"):
            continue
        spec = cls.default_tree
        methods.append(Method(f"policy_{name}", "policy", lambda b, ids, s=spec, p=name: _mcsd(b, ids, s, p),
                              tree=spec, policy=name))
    return methods
