"""Make the EAGLE-3 fixtures under tests/fixtures/eagle3/ with the `speculators` library itself.

Run it in a virtual environment of its own, never in mcsd's (speculators pins other torch and transformers
versions) and never in CI:

    python3 -m venv /work/venv-spec
    /work/venv-spec/bin/pip install torch==2.13.0          # first, so no CUDA build comes in
    /work/venv-spec/bin/pip install --no-deps speculators==0.9.0
    /work/venv-spec/bin/pip install "transformers==5.19.0" "datasets>=4,<=5.1" "loguru>=0.7.2,<=0.7.3" \
        "numpy>=2,<=2.5.4" pydantic pydantic-settings rich safetensors "tqdm>=4.66.3,<=4.70.1" typer click \
        httpx aiohttp psutil protobuf huggingface-hub openai
    /work/venv-spec/bin/python tools/make_eagle3_fixtures.py

What it writes (all float32, a few hundred kilobytes): target/, a tiny random Llama (8 layers, hidden 32,
vocabulary 96), saved by transformers; speculators/, an EAGLE-3 head the library builds for it
(`Eagle3DraftModel.from_training_args`: draft vocabulary 48, target layers 1, 4, 6, norm_before_residual true)
and saves (`save_pretrained`); speculators-qwen3/, the same with a Qwen3 draft layer (q and k norms), layers
2, 4, 5; original/, a second head (layers 2, 4, 5, EAGLE-3's default for 8 layers; norm_before_residual false)
in the original layout (flat config.json, `midlayer.*`, no `embed_tokens`), which the library's own converter
(`Eagle3Converter`) reads back, its logits checked against the head the library built; original-ids/, that
head with its layers named as SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids` would, out of order:
[4, 1, 3] (SGLang captures the input of layer id + 1, so layers 5, 2, 4, concatenated in layer order 2, 4, 5);
logits.safetensors, per head the tokens, the hidden states it reads and the library's draft logits at every
position for the first step and two chained, teacher-forced steps (`ttt_steps=3`); versions.json, the
versions of speculators, torch and transformers that made them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "eagle3"
VOCAB, DRAFT_VOCAB, HIDDEN, LAYERS, T = 96, 48, 32, 8, 10


def tiny_target(path: Path):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():                     # norms away from 1, so a norm read wrong shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def vocab_maps(seed: int):
    """t2d (V,) bool and d2t (K,) offsets: a random sorted draft vocabulary of K target ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    return t2d, ids - torch.arange(DRAFT_VOCAB)


def build_head(target_dir: Path, layer_ids, norm_before_residual: bool, seed: int, layer_type: str = "llama"):
    from transformers import AutoConfig
    from speculators.models.eagle3 import Eagle3DraftModel
    verifier = AutoConfig.from_pretrained(target_dir)
    if layer_type == "qwen3":                 # a Qwen3 draft layer over the same target
        from transformers import Qwen3Config
        verifier = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False)
    verifier.num_hidden_layers = 1            # the draft's own layer count (the library reads it from here)
    t2d, d2t = vocab_maps(seed)
    torch.manual_seed(seed)
    head = Eagle3DraftModel.from_training_args(
        verifier, t2d=t2d, d2t=d2t, verifier_name_or_path=str(target_dir), draft_vocab_size=DRAFT_VOCAB,
        norm_before_residual=norm_before_residual, ttt_steps=3, target_layer_ids=list(layer_ids),
        draft_attn_impl="eager")
    with torch.no_grad():                     # every weight random, norms away from 1
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name == "lm_head.weight":
                p.add_(0.05 * torch.randn_like(p))
    return head.eval()


def library_logits(head, hidden, tokens, steps: int = 3):
    """The library's forward over one sequence: (steps, T, K) draft logits, every position, the first
    step and the chained ones (captured at its LM head, which it calls once a step)."""
    seen = []
    hook = head.lm_head.register_forward_hook(lambda m, args, out: seen.append(out[0].detach().clone()))
    with torch.no_grad():
        head(hidden_states=hidden[None], input_ids=tokens[None], document_ids=torch.zeros(1, tokens.numel(),
             dtype=torch.long), ttt_steps=steps)
    hook.remove()
    return torch.stack(seen)


def write_original(head, path: Path, target_cfg) -> None:
    """The original EAGLE-3 layout: a flat Llama config with draft_vocab_size, `midlayer.*`, fc, norm,
    lm_head, d2t and t2d; the target's embedding is not stored."""
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    tl = head.config.transformer_layer_config
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
           **{k: getattr(tl, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                          "num_key_value_heads", "max_position_embeddings", "rms_norm_eps")},
           "num_hidden_layers": 1, "rope_theta": 10000.0, "rope_scaling": None, "vocab_size": target_cfg.vocab_size,
           "draft_vocab_size": DRAFT_VOCAB, "tie_word_embeddings": False, "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    state = {k.replace("layers.0.", "midlayer."): v.contiguous() for k, v in head.state_dict().items()
             if not k.startswith(("embed_tokens", "verifier_"))}
    save_file(state, str(path / "model.safetensors"))


def write_with_sglang_ids(source: Path, path: Path, sglang_ids) -> None:
    """The original-layout head in `source` again at `path`, its config naming its target layers as SGLang's
    `eagle_config.eagle_aux_hidden_state_layer_ids` (the output of layer i), in the order given."""
    shutil.copytree(source, path)
    cfg = {**json.loads((path / "config.json").read_text()),
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [int(i) for i in sglang_ids]}}
    (path / "config.json").write_text(json.dumps(cfg, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args(argv)                       # no options: it writes tests/fixtures/eagle3/ afresh
    from importlib import metadata
    import speculators  # noqa: F401  (first: nothing is removed where the library is missing)
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    target_dir = OUT / "target"
    target = tiny_target(target_dir)
    g = torch.Generator().manual_seed(11)
    sequence = torch.randint(0, VOCAB, (T + 1,), generator=g)
    with torch.no_grad():
        states = target(sequence[None], output_hidden_states=True).hidden_states   # (L+1) x (1, T+1, H)
    tensors = {"sequence": sequence}

    def record(name, head, ids):
        hidden = torch.cat([states[i][0, :T] for i in ids], dim=-1)               # (T, 3H): g_0 .. g_{T-1}
        tensors[f"{name}.hidden"], tensors[f"{name}.logits"] = hidden.contiguous(), \
            library_logits(head, hidden, sequence[1:]).contiguous()
        return tensors[f"{name}.logits"]

    # speculators format, as the library saves it (verifier path made relative to the fixture folder)
    spec = build_head(target_dir, (1, 4, 6), norm_before_residual=True, seed=1)
    record("speculators", spec, (1, 4, 6))
    spec.save_pretrained(OUT / "speculators")
    qwen = build_head(target_dir, (2, 4, 5), norm_before_residual=False, seed=3, layer_type="qwen3")
    record("speculators-qwen3", qwen, (2, 4, 5))
    qwen.save_pretrained(OUT / "speculators-qwen3")

    # the original layout, and the library's converter reading it back
    orig = build_head(target_dir, (2, 4, 5), norm_before_residual=False, seed=2)
    want = record("original", orig, (2, 4, 5))
    write_original(orig, OUT / "original", target.config)
    write_with_sglang_ids(OUT / "original", OUT / "original-ids", (4, 1, 3))     # layers 5, 2, 4: listed out of order
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    from speculators.models.eagle3 import Eagle3DraftModel
    converted = OUT / "converted-by-library"
    Eagle3Converter().convert(OUT / "original", converted, base_model=str(target_dir), validate=False)
    back = Eagle3DraftModel.from_pretrained(converted)
    back.config.transformer_layer_config._attn_implementation = "eager"
    back = Eagle3DraftModel.from_pretrained(converted, config=back.config).eval()
    # No embedding in the converted checkpoint (the original layout stores none): the library fills it from
    # the verifier only where still NaN, which transformers' initialisation may beat; so take it explicitly.
    back._load_verifier_weights(overwrite_embed_tokens=True)
    got = library_logits(back, tensors["original.hidden"], sequence[1:])
    diff = (got - want).abs().max().item()
    print(f"original layout read back by the library's converter: max |logit difference| {diff:.2e}")
    if diff > 1e-5:
        sys.exit("the converter read the original layout differently")
    shutil.rmtree(converted)

    for name in ("speculators", "speculators-qwen3"):
        cfg_file = OUT / name / "config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg["speculators_config"]["verifier"]["name_or_path"] = "../target"
        cfg_file.write_text(json.dumps(cfg, indent=2))
        (OUT / name / "config.py").unlink(missing_ok=True)    # a copy of the library's source; loaders never run it
    save_file(tensors, str(OUT / "logits.safetensors"))
    versions = {"speculators": metadata.version("speculators"), "torch": torch.__version__, "transformers":
                transformers.__version__, "python": sys.version.split()[0], "made_by": "tools/make_eagle3_fixtures.py"}
    (OUT / "versions.json").write_text(json.dumps(versions, indent=1) + "\n")
    AutoModelForCausalLM.from_pretrained(target_dir)           # the target loads as saved
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
