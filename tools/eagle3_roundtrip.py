"""Round trip: an EAGLE-3 head trained and exported here, loaded by the `speculators` library, gives our logits.

Two halves, in two virtual environments (the library pins other torch and transformers versions; it
never enters mcsd's, nor CI):

    .venv/bin/python tools/eagle3_roundtrip.py make /tmp/eagle3-roundtrip
    /work/venv-spec/bin/python tools/eagle3_roundtrip.py check /tmp/eagle3-roundtrip

`make` (mcsd's environment): a tiny random Llama target (8 layers) writes answers to random prompts and
labels them with its hidden states (the data engine's stages), tools/train_feature_drafter.py
--arch eagle3 trains a head on them for a few updates and writes it in the speculators layout,
tools/export_eagle3.py rewrites it in the original layout, and mcsd's drafter gives its logits at every
position of a held-out sequence: the first step and two chained steps (tree steps down a chain).

`check` (the library's environment; tools/make_eagle3_fixtures.py says how to make one): the library
loads the speculators folder (`Eagle3DraftModel.from_pretrained`) and, through its own converter, the
original one, runs its forward (`ttt_steps=3`) on the same inputs, and prints the largest difference
from our logits per layout and step; it exits 1 where one exceeds 1e-4.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

T, STEPS, TOL = 12, 3, 1e-4


def make(work: Path) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from mcsd.core.tree import DraftTree, TreeTopology
    from mcsd.drafting.pair import load_eagle3_drafter
    from mcsd.forward.lm import CachedLM
    from mcsd.train import data as td
    from mcsd.train import eagle3_export, engine, feature_head

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    target = LlamaForCausalLM(cfg).eval()
    target.save_pretrained(work / "target")
    data, layers = work / "data", (2, 4, 5)                     # EAGLE-3's default for 8 layers
    for run, n in (("fit", 24), ("held", 4)):
        g = torch.Generator().manual_seed(len(run))
        prompts = [torch.randint(3, 64, (5,), generator=g).tolist() for _ in range(n)]
        outs = engine.generate_batch(target, prompts, max_new_tokens=24, eos_ids=(), pad_id=0, topk=4)
        records = [{"key": f"{run}-{i}/0", "prompt_id": f"{run}-{i}", "category": "qa",
                    "prompt": torch.tensor(p, dtype=torch.int32), **o} for i, (p, o) in enumerate(zip(prompts, outs))]
        td.start_run(data, "runs", run, {"split": "fit" if run == "fit" else "heldout"})
        td.save_shard(data, "runs", run, records, {"n_sequences": n})
        td.start_run(data, "teacher", run, {"topk": 4, "store_hidden": True, "store_layers": list(layers)})
        labels = engine.teacher_batch(target, list(td.iter_records(data, run)), 4, True, 0, layers)
        td.save_shard(data, "teacher", run, labels, {"n_sequences": n})
    spec, orig = work / "head-speculators", work / "head-original"
    feature_head.main(["--target", str(work / "target"), "--data-dir", str(data), "--runs", "fit",
                       "--heldout-run", "held", "--window", "16", "--sub-vocab", "40", "--max-updates", "30",
                       "--threads", "1", "--arch", "eagle3", "--verifier", str((work / "target").resolve()),
                       "--out", str(spec)])
    eagle3_export.main([str(spec), str(orig), "--layout", "original", "--target", str(work / "target")])

    sequence = torch.randint(3, 64, (T + 1,), generator=torch.Generator().manual_seed(9))
    lm = CachedLM(target)
    lm.reset()
    _, states = lm.extend(sequence[:-1], hidden=layers)         # (T, 3H): what both forwards read
    tensors = {"sequence": sequence, "hidden": states.contiguous()}
    padded = torch.cat([sequence, torch.zeros(STEPS, dtype=torch.long)])   # the library feeds 0 past the end
    for name, folder in (("speculators", spec), ("original", orig)):
        drafter = load_eagle3_drafter(str(folder), target, "float32")
        ours = torch.zeros(STEPS, T, drafter.head.cfg.draft_vocab)
        for q in range(T):
            drafter.reset()
            drafter.observe_target(states[:q + 1])
            tree = DraftTree.root_only(TreeTopology.from_spec(",".join(["1"] * (STEPS - 1))), sequence[q + 1])
            ours[0, q] = drafter.begin_round(sequence[:q + 2])
            for depth in range(1, STEPS):
                tree.append_level(padded[q + 1 + depth].reshape(1), torch.tensor([depth - 1]), torch.zeros(1),
                                  torch.tensor([depth]))
                ours[depth, q] = drafter.step(tree, torch.tensor([depth]))[0]
        tensors[f"{name}.logits"] = ours
    save_file(tensors, str(work / "ours.safetensors"))
    card = json.loads((spec / "card.json").read_text())
    print(f"made {work}: a head trained for {card['training']['updates']} updates (held-out step-1 top-1 "
          f"{card['heldout_agreement'][0]['top1']:.2f}), written in both layouts, and our logits")


def library_logits(model, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(STEPS, T, K) the library's draft logits, first and chained steps (captured at its LM head)."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: seen.append(out[0].detach().clone()))
    with torch.no_grad():
        model(hidden_states=hidden[None], input_ids=tokens[None],
              document_ids=torch.zeros(1, tokens.numel(), dtype=torch.long), ttt_steps=STEPS)
    hook.remove()
    return torch.stack(seen)


def _library_model(folder: Path):
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    cfg = Eagle3SpeculatorConfig.from_pretrained(folder)
    cfg.transformer_layer_config._attn_implementation = "eager"    # CPU-friendly attention, masks as dense
    return Eagle3DraftModel.from_pretrained(folder, config=cfg).eval()


def check(work: Path) -> int:
    from importlib import metadata

    import transformers
    from safetensors.torch import load_file
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    ours = load_file(work / "ours.safetensors")
    print(f"speculators {metadata.version('speculators')}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    converted = work / "original-converted-by-library"
    Eagle3Converter().convert(work / "head-original", converted, base_model=str((work / "target").resolve()),
                              validate=False)
    worst = 0.0
    for name, folder in (("speculators", work / "head-speculators"), ("original", converted)):
        model = _library_model(folder)
        if name == "original":        # the layout stores no embedding: the verifier's, explicitly (see fixtures)
            model._load_verifier_weights(overwrite_embed_tokens=True)
        theirs = library_logits(model, ours["hidden"], ours["sequence"][1:])
        for step in range(STEPS):
            diff = (theirs[step] - ours[f"{name}.logits"][step]).abs().max().item()
            worst = max(worst, diff)
            print(f"{name:12s} layout, step {step + 1} ({'first' if step == 0 else 'chained'}): "
                  f"max |library - mcsd| = {diff:.2e} over {theirs.shape[1]} positions x {theirs.shape[2]} draft tokens")
    print("round trip " + ("ok" if worst <= TOL else "FAILED") + f": worst {worst:.2e} (bar {TOL:.0e})")
    return 0 if worst <= TOL else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=("make", "check"), help="make: mcsd's environment; check: the library's")
    ap.add_argument("work", type=Path, help="folder for the target, data, heads and logits")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.stage == "make":
        make(args.work)
        return 0
    return check(args.work)


if __name__ == "__main__":
    sys.exit(main())
