"""EAGLE-3 heads made and written here: a new head for a target (the trainer's `--arch eagle3`), and the
two layouts vLLM, SGLang and the EAGLE code load.

- speculators (`write_speculators`): what `vllm serve HEAD_DIR` and vLLM's
  `--speculative-config '{"method": "eagle3", "model": HEAD_DIR, ...}'` read:
  `speculators_model_type: "eagle3"`, the draft layer's whole config in
  `transformer_layer_config`, `eagle_aux_hidden_state_layer_ids` (layer
  inputs), `norm_before_residual` written out (readers disagree on its
  default), the verifier's name; weights `layers.N.*`, `fc`, `norm`,
  `lm_head`, `d2t`, `t2d` and the target's `embed_tokens`;
- original (`write_original`): the SafeAILab/EAGLE and SGLang layout: a flat
  Llama config with `draft_vocab_size`, weights `midlayer.*` and no
  embedding. Its readers fuse EAGLE-3's default layers (2, L/2, L-3) unless
  `eagle_config.eagle_aux_hidden_state_layer_ids` says otherwise, in SGLang's
  convention (the output of layer i, one less than the input ids used here).
  Only one draft layer fits it (`midlayer`), and only a head trained without
  `norm_before_residual`: SGLang's layer (like EAGLE's own) takes the first
  layer's residual before `hidden_norm` whatever the config says, so such a
  head is refused here rather than written for SGLang to run as another
  network.

Heads trained here (`new_eagle3_head`) take the residual before the norm, so every engine runs them alike
in either layout; the flag is written out in the speculators layout, whose vLLM reader defaults it to true.

Both are read back by `mcsd.drafting.eagle3.load_eagle3_head`, which the tests use to check a round trip;
tools/eagle3_roundtrip.py checks the speculators library reads them as written.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mcsd.drafting.eagle3 import Eagle3Config, Eagle3Head
from mcsd.drafting.feature_draft import default_feature_layers


def layer_config_for(target, layers: int = 1) -> dict:
    """The draft layers' Llama config for `target`: its width, heads, MLP width, norm epsilon and rotary
    settings (EAGLE-3's heads copy the target's layer shape)."""
    tc = target.config
    rope = getattr(tc, "rope_parameters", None) or {"rope_type": "default",
                                                    "rope_theta": float(getattr(tc, "rope_theta", 10000.0))}
    heads = tc.num_attention_heads
    return {"model_type": "llama", "hidden_size": tc.hidden_size, "intermediate_size": tc.intermediate_size,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": getattr(tc, "num_key_value_heads", None) or heads,
            "head_dim": getattr(tc, "head_dim", None) or tc.hidden_size // heads, "hidden_act": "silu",
            "max_position_embeddings": tc.max_position_embeddings, "rms_norm_eps": float(tc.rms_norm_eps),
            "rope_parameters": dict(rope), "vocab_size": target.get_output_embeddings().weight.shape[0],
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}


def new_eagle3_head(target, aux_layers: tuple[int, ...], draft_ids: torch.Tensor, layers: int = 1) -> Eagle3Head:
    """A trainable EAGLE-3 head for `target` reading its hidden states `aux_layers` (layer inputs), scoring
    the target ids `draft_ids` (ascending; all of them: the whole vocabulary). The LM head starts as the
    target's rows for those ids; everything else at transformers' initialisation."""
    vocab = target.get_output_embeddings().weight.shape[0]
    draft_ids = draft_ids.flatten().long().cpu()
    if (draft_ids.diff() <= 0).any() or draft_ids.min() < 0 or draft_ids.max() >= vocab:
        raise ValueError("draft vocabulary ids must be distinct target ids in ascending order")
    # norm_before_residual false: the one first layer vLLM, SGLang and EAGLE's own code all run as trained
    cfg = Eagle3Config(hidden=target.config.hidden_size, vocab_size=vocab, draft_vocab=draft_ids.numel(),
                       layer_config=layer_config_for(target, layers), aux_layers=tuple(aux_layers),
                       norm_before_residual=False)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        head.d2t.copy_(draft_ids - torch.arange(draft_ids.numel()))
        head.lm_head.weight.copy_(target.get_output_embeddings().weight.detach().float().cpu()[draft_ids])
    return head


def _tensors(head: Eagle3Head, embed_weight: torch.Tensor | None) -> dict[str, torch.Tensor]:
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    state.pop("embed_tokens.weight", None)
    t2d = torch.zeros(head.cfg.vocab_size, dtype=torch.bool)
    t2d[head.vocab_ids.cpu()] = True
    state["t2d"] = t2d
    if embed_weight is not None:
        state["embed_tokens.weight"] = embed_weight.detach().to("cpu", state["fc.weight"].dtype).contiguous()
    return state


def _dtype_name(head: Eagle3Head) -> str:
    return str(head.fc.weight.dtype).removeprefix("torch.")


def write_speculators(head: Eagle3Head, out: str | Path, verifier: str, embed_weight: torch.Tensor,
                      speculative_tokens: int = 3, verifier_architectures=("LlamaForCausalLM",),
                      card: dict | None = None) -> Path:
    """Write `head` in the speculators layout (vLLM's).

    Args:
        head: a head whose `aux_layers` are set.
        out: folder to write (created).
        verifier: the target's name or path, as vLLM and the library will look it up.
        embed_weight: (V, H) the target's input embedding (stored as the head's `embed_tokens`).
        speculative_tokens: the chain length vLLM drafts by default.
        verifier_architectures: the target's transformers architectures.
        card: written as card.json beside (mcsd's training record), if given.
    """
    if not head.cfg.aux_layers:
        raise ValueError("the head's target layers are not set")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file
    layer = dict(head.cfg.layer_config)
    layer.setdefault("architectures", ["LlamaForCausalLM"])
    layer["dtype"] = _dtype_name(head)
    config = {
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)}},
        "transformer_layer_config": layer, "draft_vocab_size": head.cfg.draft_vocab,
        "eagle_aux_hidden_state_layer_ids": list(head.cfg.aux_layers),
        "norm_before_residual": bool(head.cfg.norm_before_residual), "norm_before_fc": False, "fc_norm": False,
        "norm_output": False, "target_hidden_size": None, "tie_word_embeddings": False, "dtype": _dtype_name(head)}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(_tensors(head, embed_weight), str(out / "model.safetensors"))
    if card is not None:
        (out / "card.json").write_text(json.dumps(card, indent=1) + "\n")
    return out


def write_original(head: Eagle3Head, out: str | Path, target_layers: int, card: dict | None = None) -> Path:
    """Write `head` in the original EAGLE-3 layout (SafeAILab/EAGLE, SGLang).

    Args:
        target_layers: the target's decoder layer count: where the head's layers are EAGLE-3's default for
            it, the config names none; else it names them in SGLang's convention (the output of layer i).
    Raises:
        ValueError (one line) for a head the layout cannot hold: several draft layers; layer 0's input,
        which has no SGLang id; `norm_before_residual`, which SGLang's layer does not read.
    """
    cfg = head.cfg
    if cfg.layers != 1:
        raise ValueError(f"the original EAGLE-3 layout holds one draft layer, not {cfg.layers}")
    if cfg.layer_config.get("model_type", "llama") != "llama":
        raise ValueError("the original EAGLE-3 layout holds a Llama draft layer")
    if cfg.norm_before_residual:
        raise ValueError("this head was trained with norm_before_residual, which SGLang's EAGLE-3 layer ignores "
                         "(it takes the residual before the norm): SGLang would run it as another network; "
                         "write it in the speculators layout, which vLLM reads with the flag")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file
    layer = {k: v for k, v in cfg.layer_config.items() if k not in ("rope_parameters", "architectures", "dtype")}
    rope = dict(cfg.layer_config.get("rope_parameters") or {})
    layer["rope_theta"] = float(rope.pop("rope_theta", 10000.0))
    kind = rope.pop("rope_type", "default")
    layer["rope_scaling"] = None if kind == "default" else {"rope_type": kind, **rope}
    config = {"architectures": ["LlamaForCausalLMEagle3"], **layer, "draft_vocab_size": cfg.draft_vocab,
              "torch_dtype": _dtype_name(head)}
    if tuple(cfg.aux_layers) != default_feature_layers(target_layers):
        if min(cfg.aux_layers) < 1:
            raise ValueError(f"target layers {list(cfg.aux_layers)} include layer 0's input, which the original "
                             f"layout cannot name")
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layers]}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k: v
             for k, v in _tensors(head, None).items()}
    save_file(state, str(out / "model.safetensors"))
    if card is not None:
        (out / "card.json").write_text(json.dumps(card, indent=1) + "\n")
    return out


def export(source: str | Path, out: str | Path, layout: str, target, verifier: str | None = None) -> Path:
    """Read the EAGLE-3 head in `source` (either layout) for `target` and write it to `out` in `layout`
    ("speculators" or "original"); `verifier` names the target in a speculators config (default: the
    verifier `source` names, else the target's name_or_path)."""
    from mcsd.drafting.eagle3 import load_eagle3_head, read_config
    n_layers = target.config.num_hidden_layers
    head = load_eagle3_head(source, n_layers)
    card_file = Path(source) / "card.json"
    card = json.loads(card_file.read_text()) if card_file.is_file() else None
    if layout == "original":
        return write_original(head, out, n_layers, card)
    if layout != "speculators":
        raise ValueError(f"unknown layout {layout!r}; choose speculators or original")
    named = ((read_config(source) or {}).get("speculators_config") or {}).get("verifier", {}).get("name_or_path")
    verifier = verifier or named or getattr(target.config, "_name_or_path", "") or "target"
    embed = head.embed_tokens.weight if head.embed_tokens is not None else target.get_input_embeddings().weight
    return write_speculators(head, out, verifier, embed, card=card,
                             verifier_architectures=getattr(target.config, "architectures", None) or ["LlamaForCausalLM"])


def main(argv=None) -> int:
    import argparse

    from mcsd.config import ConfigError
    from mcsd.drafting.eagle3 import Eagle3FormatError, eagle3_layout
    from mcsd.drafting.pair import load_model
    from mcsd.errors import ModelLoadError
    ap = argparse.ArgumentParser(description="Write an EAGLE-3 head (either layout, e.g. one trained with "
                                             "tools/train_feature_drafter.py --arch eagle3) in the layout another "
                                             "engine loads: speculators (vllm serve) or original (SGLang, EAGLE).")
    ap.add_argument("head", type=Path, help="the head's folder")
    ap.add_argument("out", type=Path, help="folder to write")
    ap.add_argument("--layout", choices=("speculators", "original"), required=True)
    ap.add_argument("--target", required=True, help="the head's target (preset, folder, GGUF or hub id)")
    ap.add_argument("--verifier", default=None,
                    help="speculators layout: the target's name as vLLM will look it up (default: the one the "
                         "head names, else --target)")
    args = ap.parse_args(argv)
    if eagle3_layout(args.head) is None:              # before the target loads: a wrong folder costs nothing
        raise SystemExit(f"export_eagle3: {args.head} holds no EAGLE-3 head (a config.json in the original or "
                         f"the speculators layout)")
    try:
        target = load_model(args.target, dtype="float32")
        out = export(args.head, args.out, args.layout, target, args.verifier or None)
    except (Eagle3FormatError, ModelLoadError, ConfigError, ValueError, OSError) as exc:
        raise SystemExit(f"export_eagle3: {exc}") from None
    print(f"wrote {out} ({args.layout} layout)")
    return 0
