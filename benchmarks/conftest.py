"""Shared setup for the speed comparisons: options, the model pair, the prompts, the baseline's results.

Run:  pytest benchmarks/test_speed.py --benchmark-only --benchmark-json=bench.json && python tools/bench_report.py bench.json
      (add --bench-full for the whole held-out split, --bench-smoke for a 1-prompt, 16-token check;
      docs/benchmarks.md has the commands)
"""

from __future__ import annotations

import platform

import pytest
import torch

from mcsd.config import WEIGHTS


def pytest_addoption(parser):
    g = parser.getgroup("mcsd benchmarks")
    g.addoption("--bench-prompts", default=None, help="Spec-Bench style JSONL (default: benchmarks/data/spec_bench/question.jsonl, or $MCSD_SPEC_BENCH)")
    g.addoption("--bench-split", default="heldout", choices=("heldout", "fit", "all"))
    g.addoption("--bench-full", action="store_true", help="every prompt of the split, not one per category group")
    g.addoption("--bench-per-group", type=int, default=1, help="prompts per category group (default 1)")
    g.addoption("--bench-smoke", action="store_true", help="one prompt, 16 tokens: a quick harness check")
    g.addoption("--bench-max-new-tokens", type=int, default=128)
    g.addoption("--bench-target", default=None, help="target source (default: the embedded preset)")
    g.addoption("--bench-draft", default=None, help="draft source (default: the preset's draft)")
    g.addoption("--bench-drafter", default=None, choices=("model", "feature"),
                help="with the preset: standalone draft model or target-feature head (default: the preset's own "
                     "choice; Hugging Face assisted generation keeps the preset's draft model)")
    g.addoption("--bench-dtype", default="bfloat16",
                help="float32, bfloat16, float16, or auto (what --dtype auto picks for this pair on this machine)")
    g.addoption("--bench-weights", default="dense", choices=WEIGHTS + ("auto",),
                help="the target's weights: dense, q4 (its Q4_1 GGUF's codes; with a --bench-dtype other than "
                     "auto, in the dtype q4 computes in without measurements), q4q8 (those codes on 8-bit "
                     "activations, float32), or auto (with --bench-dtype auto: the weights and compute dtype "
                     "mcsd-generate's defaults choose here)")
    g.addoption("--bench-device", default="cpu")
    g.addoption("--bench-threads", type=int, default=None, help="torch threads (default: torch's choice)")
    g.addoption("--bench-temperature", type=float, default=0.0,
                help="sample at this temperature (0, the default, is greedy); each prompt gets a fixed seed")
    g.addoption("--bench-top-p", type=float, default=1.0, help="nucleus sampling's top-p, with --bench-temperature")
    g.addoption("--bench-interleave", action="store_true",
                help="run the selected methods prompt by prompt in rotation (one interleaved run) instead of "
                     "one method after another; each test then reports its share of that run")
    g.addoption("--bench-turns", type=int, default=1,
                help="with --bench-interleave: each prompt runs this many turns of the rotation, and a "
                     "method's time on it is its quickest turn (a busy spell of the machine only adds time); "
                     "the figures over every turn are recorded beside it")


def pytest_configure(config):
    if config.getoption("--bench-turns") < 1:
        raise pytest.UsageError("--bench-turns must be 1 or more")
    if config.getoption("--bench-turns") > 1 and not config.getoption("--bench-interleave"):
        raise pytest.UsageError("--bench-turns needs --bench-interleave (turns of one rotation)")
    weights = config.getoption("--bench-weights")
    from mcsd.forward import quant
    if weights in quant.ON_CODES and not quant.dtypes(weights):        # before any model loads
        raise pytest.UsageError(f"--bench-weights {weights} runs on mcsd's native kernel, which is not used here "
                                f"({quant.describe_kernel()}); use --bench-weights q4")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Remember which methods were selected (-k, -m, node ids), for the interleaved run: after
    pytest's own selection has removed the others from `items`."""
    config.selected_methods = {item.callspec.params["method"].name for item in items
                               if hasattr(item, "callspec") and "method" in item.callspec.params}


class Bench:
    """Everything the methods share within one session."""

    @property
    def sampling(self) -> dict:
        """The sampling settings every method runs with (empty: greedy)."""
        return {} if self.temperature == 0 else {"temperature": self.temperature, "top_p": self.top_p}

    @staticmethod
    def seed_for(ids: torch.Tensor) -> int:
        """A prompt's fixed seed: a function of its tokens, the same for every method and run."""
        return (int((ids.long() * (torch.arange(ids.numel()) % 997 + 1)).sum()) * 1_000_003 + ids.numel()) % 2**31

    def __init__(self, config):
        from mcsd import load_model_pair
        from mcsd.drafting.pair import load_model
        from mcsd.loading.data import chat_ids, load_prompts, stratified
        from mcsd.loading.models import preset_draft_dir
        from mcsd.loading.presets import DEFAULT_PRESET, PRESETS

        opt = config.getoption
        if opt("--bench-threads"):
            torch.set_num_threads(opt("--bench-threads"))
        self.smoke = opt("--bench-smoke")
        self.interleave = opt("--bench-interleave")
        self.interleaved: dict | None = None         # method -> question_id -> Run, once computed
        self.turns = opt("--bench-turns")
        self.every_turn: dict = {}                   # method -> question_id -> [seconds of each turn]
        self.turns_differ: dict = {}                 # method -> question_ids whose turns wrote different text
        self.max_new_tokens = 16 if self.smoke else opt("--bench-max-new-tokens")
        self.temperature, self.top_p = opt("--bench-temperature"), opt("--bench-top-p")
        self.dtype, self.device, self.weights = opt("--bench-dtype"), opt("--bench-device"), opt("--bench-weights")
        from mcsd.forward import quant
        if self.weights in quant.ON_CODES and self.dtype != "auto":
            # what q4 (q4q8) computes in here without measurements, whatever --bench-dtype says
            self.dtype = quant.compute_dtype() if self.weights == "q4" else quant.dtypes("q4q8")[0]
        if self.weights == "auto" and self.dtype != "auto":
            self.weights = "dense"                     # auto weighs q4 against the dense dtypes, as the CLI does
        auto = self.dtype == "auto"
        self.target, self.draft, self.tokenizer = load_model_pair(
            opt("--bench-target"), opt("--bench-draft"), dtype="float32" if auto else self.dtype,
            device=self.device, drafter=opt("--bench-drafter"), weights="dense" if auto else self.weights)
        self.dtype_reason = None
        if auto:                                       # as mcsd-generate --dtype auto --weights ... decides it
            from mcsd.decoding.choice import apply_choice, choose_dtype
            from mcsd.loading.models import gguf_source
            gguf = gguf_source(opt("--bench-target") or DEFAULT_PRESET) if self.weights in ("auto", *quant.ON_CODES) else None
            choice = choose_dtype(self.target, self.draft, gguf=gguf, weights=self.weights)
            self.dtype, self.dtype_reason, self.weights = choice.dtype, choice.reason, choice.weights
            self.target, self.draft = apply_choice(self.target, self.draft, choice, gguf)
        self.target_preset = PRESETS.get(opt("--bench-target") or DEFAULT_PRESET)
        self.draft_is_model = isinstance(self.draft, torch.nn.Module)
        # Hugging Face assisted generation needs a standalone draft model: with a
        # preset's feature head, it still runs with the preset's own draft model,
        # so both drafters are compared in one run.
        self.assistant = self.draft if self.draft_is_model else None
        if self.assistant is None and opt("--bench-draft") is None:
            preset = PRESETS[opt("--bench-target") or DEFAULT_PRESET]
            self.assistant = load_model(str(preset_draft_dir(preset, "model")), self.dtype, self.device, role="draft")
        prompts = load_prompts(opt("--bench-prompts"), split=opt("--bench-split"))
        if self.smoke:
            prompts = prompts[:1]
        elif not opt("--bench-full"):
            prompts = stratified(prompts, opt("--bench-per-group"))
        self.prompts = [(p, torch.tensor(chat_ids(self.tokenizer, p.text))) for p in prompts]
        self.decoders: dict = {}                       # (tree, policy) -> TreeDecoder, reused across prompts
        self.workers: dict = {}                        # name -> llama_worker.Worker (another engine's process)
        self.baseline: dict[int, list[int]] = {}      # question_id -> tokens of the reference method
        self.baseline_time: dict[int, float] = {}
        from mcsd.costs.store import load_or_measure
        load_or_measure(self.target, self.draft)       # calibration (once per machine) stays out of every timing
        load_or_measure(self.target, None)             # ... also the target alone (what context drafting prices)
        with torch.inference_mode():                   # first-call overheads stay out of every timing
            self.target.generate(self.prompts[0][1][None], max_new_tokens=4, do_sample=False,
                                 attention_mask=torch.ones(1, self.prompts[0][1].numel(), dtype=torch.long),
                                 pad_token_id=self.tokenizer.eos_token_id)
        self.environment = {
            "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
            "cpu_count": __import__("os").cpu_count(), "threads": torch.get_num_threads(),
            "dtype": self.dtype, "dtype_reason": self.dtype_reason, "weights": self.weights, "device": self.device,
            "torch": torch.__version__,
            "host": __import__("mcsd.costs.profile", fromlist=["machine_info"]).machine_info(str(self.device)),
            "transformers": __import__("transformers").__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "prompts": len(self.prompts), "max_new_tokens": self.max_new_tokens, "smoke": self.smoke,
            "turns": self.turns,
            "temperature": self.temperature, "top_p": self.top_p,
            "llama_cpp": "in its own process",           # see methods.llama_cpp_worker
            "drafter": "model" if self.draft_is_model else type(self.draft).__name__,
            "hf_assistant": getattr(getattr(self.assistant, "config", None), "_name_or_path", None),
        }

    def close(self) -> None:
        """End the worker processes the session started."""
        while self.workers:
            self.workers.popitem()[1].close()


@pytest.fixture(scope="session")
def bench(request):
    b = Bench(request.config)
    yield b
    b.close()
