"""Distil a small standalone draft model from its target (self-distillation).

The draft is a plain `LlamaForCausalLM` that shares the target's tokenizer,
so `AutoModelForCausalLM.from_pretrained(dir)` loads it and any speculative
decoder can use it. It learns the target's next-token distribution (top-k
soft labels from tools/target_data.py) on text the target wrote itself.

Architecture (defaults in DraftConfig), and why:
- hidden 256, tied embeddings. With a 49152-token vocabulary the embedding /
  LM head is most of a small model (12.6M of ~16M parameters) and most of
  its per-token compute; 256 wide keeps the bfloat16 file near 32 MB (the
  bar is 40 MB) and the head cheap.
- 4 layers to train, 3 to ship; 4 query heads of 64, 2 KV heads. On CPU a
  1-token forward is dominated by per-layer overhead and by reading the LM
  head, not by FLOPs, so depth is what costs. Trained with 4 layers (room
  for copying from context, which needs two, on top of n-gram statistics),
  the draft reached the agreement bars but cost 0.155-0.172 of a target step
  (interleaved, bfloat16, 2 threads), over the 0.15 bar; with 3 layers the
  same width costs 0.131-0.151 (the trained 3-layer draft: 0.140-0.151) and
  with 2 about 0.12. So the shipped draft
  keeps 3 of the trained 4 layers (--init-layers; dropping layer 1 loses the
  least: top-1 37.1% -> 34.1% before any further training) and is trained
  on from there.
- RoPE theta and max positions as the target, so it reads the same contexts.

Initialisation from the target:
- embedding = the target's embedding E projected on a 256-direction basis Q
  of the target's width (576), so a draft hidden state h_d = Q h_t gives
  logits (E Q^T) Q h_t = E (Q^T Q h_t): the target's logits with its
  final hidden state kept to that subspace. The default basis is the top
  principal directions (uncentred) of the target's final hidden states on
  the training text: the subspace its LM head actually reads. Measured on
  the target's own responses, that projection keeps the target's top-1
  token 64% of the time, against 8% for the top singular directions of E
  (--embed-basis embedding), which spread the width evenly over all
  49152 tokens instead of the ones the target uses. The basis is saved
  beside the model (hidden_basis.safetensors) so --init can go on with it;
  the card records both figures (training.basis_check).
- final norm weight starts at 0.15, not 1: at init the residual stream is
  the input token's embedding, and with tied embeddings a full-scale final
  norm makes "repeat the input token" the initial prediction, a minimum the
  model is slow to leave.
- the layers start random (std 0.02, output projections scaled down by
  depth as in GPT-2), so the stack starts near the identity.

Training: soft cross-entropy to the target's renormalised top-k distribution
(optionally plus hard cross-entropy to the text's next token), on response
positions only (prompt tokens are context, not labels), plus
--hidden-weight x the relative squared error between the draft's final
hidden state and Q h_t where the data engine stored h_t: 256 numbers a
position against 8 probabilities, a denser signal from the same
generated text. On a CPU the LM head
is most of a step, so most steps use a sampled softmax (the tokens the
batch's labels name plus random negatives) and one in `--full-softmax-every`
the full one; AdamW with warmup
and a cosine decay over the time budget; checkpoints in the cache folder
every few minutes, so a killed run resumes where it stopped; held-out top-1
and top-4 agreement with the target's greedy responses measured periodically.

Limitations: CPU-friendly, not fast (no packing, no compile); the label is
the target's top-k only, so mass outside the top-k is not taught.

Example:
    python tools/distill_draft.py --runs fit-greedy si-greedy fit-t08 selfinstruct-meta \\
        --heldout-run heldout-greedy-bf16 --time-budget-min 35
"""

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from mcsd.train import data as td
from mcsd.train import portable

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "models" / "smollm2-135m-draft"


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int = 256  # embedding/LM head width: the size and cost lever
    num_hidden_layers: int = 4  # depth is what a 1-token CPU forward pays for
    num_attention_heads: int = 4  # head_dim 64 like the target
    num_key_value_heads: int = 2  # GQA: a smaller KV cache per drafted token
    intermediate_size: int = 768  # 3x hidden, a little under Llama's 8/3 * 2
    final_norm_init: float = 0.15  # see module docstring: don't start by copying the input
    init_std: float = 0.02
    embed_basis: str = "hidden"  # "hidden" or "embedding": the target directions the draft's width keeps


EMBED_BASES = ("hidden", "embedding")


def hidden_basis(hidden: torch.Tensor, k: int) -> torch.Tensor:
    """The top-k principal directions (uncentred SVD: the direction all rows
    share is kept) of a set of rows: of the target's final hidden states, the
    subspace its LM head actually reads; of its embedding, the directions
    that spread all tokens apart (--embed-basis embedding).

    Args: hidden (N, C_target) float. Returns (k, C_target) float32, rows orthonormal.
    """
    if hidden.shape[0] < k:
        raise ValueError(f"a {k}-direction basis needs at least {k} hidden states, got {hidden.shape[0]}")
    _, _, Vh = torch.linalg.svd(hidden.float(), full_matrices=False)
    return Vh[:k].contiguous()


def build_draft(target, cfg: DraftConfig, basis: torch.Tensor):
    """A LlamaForCausalLM draft, initialised from the target.

    Args:
        target: the target LlamaForCausalLM (any dtype).
        basis: (hidden_size, C_target) orthonormal rows (`hidden_basis` of
            hidden states or of the embedding); the draft's embedding is
            the target's projected on them.
    Returns:
        draft in float32 (trained in float32, shipped in bfloat16).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = target.config
    config = LlamaConfig(
        vocab_size=tc.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.hidden_size // cfg.num_attention_heads,
        max_position_embeddings=tc.max_position_embeddings, rope_parameters=dict(tc.rope_parameters),
        rms_norm_eps=tc.rms_norm_eps, tie_word_embeddings=True, initializer_range=cfg.init_std,
        bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id,
    )
    torch.manual_seed(0)
    draft = LlamaForCausalLM(config).float()

    # embedding (= LM head): the target's, projected on the basis
    E = target.get_input_embeddings().weight.detach().float()  # (V, C_target)
    if basis.shape != (cfg.hidden_size, E.shape[1]):
        raise ValueError(f"basis {tuple(basis.shape)} does not map the target's width {E.shape[1]} "
                         f"to the draft's {cfg.hidden_size}")
    E_draft = E @ basis.T  # (V, C)
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(E_draft)
        draft.model.norm.weight.fill_(cfg.final_norm_init)
        # residual-branch outputs start small so the stack starts near identity (GPT-2)
        for layer in draft.model.layers:
            for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
                w.normal_(0.0, cfg.init_std / math.sqrt(2 * cfg.num_hidden_layers))
    return draft


# -----------------------------------------------------------------------------
# Data: prompt + response sequences, labels on response positions


def make_sequence(example: dict, max_len: int) -> dict:
    """One training sequence: the prompt (left-truncated so the whole thing
    fits in max_len) then the response. Labels are per response position.

    Returns: input_ids (L,) long, label_start (int): input index whose output
    predicts response[0], topk_ids (R, k) long, topk_probs (R, k) float,
    next_ids (R,) long (the text's own next token), hidden (R, C_target)
    float16 or None: the target's final hidden state where one was stored.
    """
    prompt, response = example["prompt"].long(), example["response"].long()
    R = min(len(response), max_len - 1)
    keep_prompt = max(1, min(len(prompt), max_len - R))
    input_ids = torch.cat([prompt[-keep_prompt:], response[: R - 1]])  # the last token predicts nothing
    return {
        "input_ids": input_ids,
        "label_start": keep_prompt - 1,
        "topk_ids": example["topk_ids"][:R].long(),
        "topk_probs": example["topk_probs"][:R].float(),
        "next_ids": response[:R],
        "hidden": example["hidden"][:R].clone() if "hidden" in example else None,  # not a view of all layers
    }


def sample_hidden(seqs: list[dict], n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """About n target hidden states from randomly chosen sequences (whole
    sequences, so a fixed seed and data give the same sample).

    Returns hidden (n', C_target) float32 and the target's top-1 token there (n',)."""
    order = [i for i in range(len(seqs)) if seqs[i]["hidden"] is not None]
    random.Random(seed).shuffle(order)
    picked, total = [], 0
    for i in order:
        if total >= n:
            break
        picked.append(i)
        total += len(seqs[i]["hidden"])
    hidden = torch.cat([seqs[i]["hidden"] for i in picked])[:n].float()
    return hidden, torch.cat([seqs[i]["topk_ids"][:, 0] for i in picked])[:n]


@torch.no_grad()
def basis_top1(embedding: torch.Tensor, basis: torch.Tensor, hidden: torch.Tensor, top1: torch.Tensor) -> float:
    """How often the target's own top-1 token survives keeping its final
    hidden state to the basis: argmax of (E Q^T)(Q h) against argmax of E h.
    The most a draft on that basis could agree if it predicted Q h exactly.

    Args: embedding (V, C_target), basis (C, C_target), hidden (N, C_target), top1 (N,)."""
    logits = (hidden @ basis.T) @ (embedding @ basis.T).T  # (N, V)
    return (logits.argmax(-1) == top1).float().mean().item()


def make_batches(seqs: list[dict], tokens_per_batch: int, shuffle: bool, seed: int = 0) -> list[list[int]]:
    """Indices of sequences grouped by similar length (little padding), each
    batch about tokens_per_batch padded tokens; batch order shuffled."""
    rng = random.Random(seed)
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i]["input_ids"]), rng.random()))
    batches, batch, longest = [], [], 0
    for i in order:
        n = len(seqs[i]["input_ids"])
        if batch and max(longest, n) * (len(batch) + 1) > tokens_per_batch:
            batches.append(batch)
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, n)
    if batch:
        batches.append(batch)
    if shuffle:
        rng.shuffle(batches)
    return batches


def collate(seqs: list[dict], pad_id: int) -> dict:
    """Right-pad a batch and gather where the labels sit.

    Returns a dict: input_ids (B, L), attention_mask (B, L), rows (N,),
    cols (N,) (the N labelled positions), topk_ids (N, k), topk_probs (N, k),
    next_ids (N,), and, when some sequence has hidden states, hidden
    (N_h, C_target) float16 with hidden_at (N_h,): which of the N they are.
    """
    B, L = len(seqs), max(len(s["input_ids"]) for s in seqs)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    rows, cols = [], []
    for b, s in enumerate(seqs):
        n = len(s["input_ids"])
        input_ids[b, :n] = s["input_ids"]
        attention_mask[b, :n] = 1
        R = len(s["next_ids"])
        rows.append(torch.full((R,), b))
        cols.append(torch.arange(s["label_start"], s["label_start"] + R))
    cat = lambda name: torch.cat([s[name] for s in seqs])  # noqa: E731
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "rows": torch.cat(rows),
             "cols": torch.cat(cols), "topk_ids": cat("topk_ids"), "topk_probs": cat("topk_probs"),
             "next_ids": cat("next_ids")}
    has = torch.tensor([s.get("hidden") is not None for s in seqs])  # (B,)
    if has.any():
        batch["hidden"] = torch.cat([s["hidden"] for s in seqs if s.get("hidden") is not None])
        batch["hidden_at"] = has[batch["rows"]].nonzero().squeeze(1)
    return batch


def label_hidden(draft, batch: dict) -> torch.Tensor:
    """The draft's final (normed) hidden state at the labelled positions. (N, C)"""
    hidden = draft.model(input_ids=batch["input_ids"],
                         attention_mask=batch["attention_mask"]).last_hidden_state  # (B, L, C)
    return hidden[batch["rows"], batch["cols"]]


def head_logits(draft, hidden, vocab=None):
    """The LM head on N hidden states only (the costly part of a small model
    runs on the labelled positions, not B*L).

    vocab: optional (V',) token ids; logits then cover only those columns.
    Returns (N, V) or (N, V') float32."""
    if vocab is None:
        return draft.lm_head(hidden).float()
    return F.linear(hidden, draft.lm_head.weight[vocab]).float()  # (N, V')


def sampled_vocab(topk_ids, next_ids, vocab_size: int, n_negatives: int, generator=None):
    """The columns of a sampled softmax: every token some label in the batch
    names (the target's top-k: the draft's real competitors at those
    positions) plus n_negatives random others, so the long tail is pushed
    down too. A 4k-token batch names a few thousand distinct tokens, so the
    head costs a few times less than over all 49152.

    Returns vocab (V',) sorted ids, topk_ids and next_ids remapped to columns.
    """
    named = torch.cat([topk_ids.flatten(), next_ids])
    negatives = torch.randint(vocab_size, (n_negatives,), generator=generator)
    vocab = torch.cat([named, negatives]).unique()  # (V',) sorted
    return vocab, torch.searchsorted(vocab, topk_ids), torch.searchsorted(vocab, next_ids)


def hidden_loss(draft_hidden, target_hidden, basis):
    """Relative squared error between the draft's final hidden state and the
    target's projected on the basis the draft's embedding was built from:
    where they match, the draft's tied head gives the target's logits
    restricted to that subspace. A dense signal (hidden_size numbers a
    position) beside the top-k labels.

    Args: draft_hidden (N, C), target_hidden (N, C_target), basis (C, C_target).
    """
    goal = target_hidden.float() @ basis.T  # (N, C)
    return ((draft_hidden - goal).pow(2).sum(-1) / goal.pow(2).sum(-1).clamp(min=1e-6)).mean()


def distill_loss(logits, topk_ids, topk_probs, next_ids, hard_weight: float = 0.0):
    """Soft cross-entropy to the target's renormalised top-k distribution,
    plus hard_weight * cross-entropy to the text's next token.

    Args: logits (N, V), topk_ids (N, k), topk_probs (N, k), next_ids (N,).
    """
    logq = logits.log_softmax(-1)  # (N, V)
    p_target = topk_probs / topk_probs.sum(-1, keepdim=True)  # (N, k)
    soft = -(p_target * logq.gather(-1, topk_ids)).sum(-1).mean()
    if hard_weight == 0:
        return soft
    return soft + hard_weight * F.nll_loss(logq, next_ids)


@torch.no_grad()
def agreement(draft, seqs: list[dict], pad_id: int, tokens_per_batch: int = 8192) -> dict:
    """Teacher-forced agreement of the draft with the text's next token (for
    greedy target text: the target's greedy token).

    Returns {"top1": fraction of positions where the draft's argmax is the
    token, "top4": fraction where the token is in the draft's top 4, "n"}.
    """
    draft.eval()
    hit1 = hit4 = n = 0
    for idx in make_batches(seqs, tokens_per_batch, shuffle=False):
        batch = collate([seqs[i] for i in idx], pad_id)
        next_ids = batch["next_ids"]
        top4 = head_logits(draft, label_hidden(draft, batch)).topk(4, dim=-1).indices  # (N, 4)
        hit1 += (top4[:, 0] == next_ids).sum().item()
        hit4 += (top4 == next_ids[:, None]).any(-1).sum().item()
        n += len(next_ids)
    draft.train()
    return {"top1": hit1 / max(n, 1), "top4": hit4 / max(n, 1), "n": n}


# -----------------------------------------------------------------------------
# Export


BASIS_FILE = "hidden_basis.safetensors"


def save_basis(basis: torch.Tensor, path: Path):
    from safetensors.torch import save_file

    save_file({"basis": basis.contiguous()}, str(path))


def load_basis(path: Path) -> torch.Tensor:
    """The (C, C_target) basis a draft's embedding was built from (saved beside it)."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))["basis"].float()
    except Exception as exc:  # safetensors raises its own error types for a corrupt file
        raise ValueError(f"{path} is not a readable basis file ({exc})") from exc


def export_draft(draft, out_dir: Path, tokenizer, card_update: dict, basis: torch.Tensor | None = None):
    """Write the draft as bfloat16 safetensors + config + the target's
    tokenizer (so the folder loads on its own), and merge card_update into card.json. With a basis,
    also the target-to-draft projection the embedding was built from
    (what --init needs to go on with --hidden-weight)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shipped = type(draft)(draft.config)
    shipped.load_state_dict(draft.state_dict())
    shipped = shipped.to(torch.bfloat16)
    shipped.config.dtype = "bfloat16"
    shipped.save_pretrained(out_dir, safe_serialization=True)
    if basis is not None:
        save_basis(basis, out_dir / BASIS_FILE)
    tokenizer.save_pretrained(out_dir)
    card_path = out_dir / "card.json"
    card = json.loads(card_path.read_text()) if card_path.exists() else {}
    card.update(card_update)
    card_path.write_text(json.dumps(portable(card), indent=2) + "\n")


def select_layers(state: dict, keep: list[int], n_layers: int) -> dict:
    """A deeper draft's weights with only the layers `keep` (in that order),
    renumbered 0..len(keep)-1: how a shallower draft starts from a trained one.

    state: a LlamaForCausalLM state dict with n_layers layers.
    """
    if not keep or len(set(keep)) != len(keep) or not all(0 <= i < n_layers for i in keep):
        raise ValueError(f"layers to keep must be distinct indices in 0..{n_layers - 1}, got {keep}")
    renumber = {old: new for new, old in enumerate(keep)}
    out = {}
    for name, value in state.items():
        if name.startswith("model.layers."):
            index, rest = name.removeprefix("model.layers.").split(".", 1)
            if (new := renumber.get(int(index))) is None:
                continue
            name = f"model.layers.{new}.{rest}"
        out[name] = value
    return out


def n_params(model) -> int:
    """Unique parameters (the tied embedding / LM head counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# -----------------------------------------------------------------------------


def main(argv=None):
    """Parse, build (the data, the basis, the draft, its optimiser), train, report (the draft and its
    card written); a mistake in the data or the settings ends it with one line."""
    args = parse_args(argv)
    try:
        run = build(args)
        train(run)
        report(run, argv)
    except td.DataError as exc:
        sys.exit(str(exc))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=td.DEFAULT_TARGET)
    parser.add_argument("--data-dir", default=None, help="default: $MCSD_CACHE/data/<target-name>")
    parser.add_argument("--runs", nargs="+", required=True, help="response runs to train on (fitting split only)")
    parser.add_argument("--heldout-run", default=None, help="greedy responses to held-out prompts, for eval")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--init", default=None,
                        help="go on training this saved draft (same architecture, or fewer layers with "
                             "--init-layers), e.g. the shipped one on new data")
    parser.add_argument("--init-layers", type=int, nargs="+", default=None,
                        help="with --init from a deeper draft: its layers to keep, in order (as many as "
                             "--num-hidden-layers), e.g. 0 1 3")
    parser.add_argument("--ckpt-dir", default=None, help="default: $MCSD_CACHE/checkpoints/<out-name>")
    parser.add_argument("--time-budget-min", type=float, default=30.0, help="training wall clock (lr schedule)")
    parser.add_argument("--max-steps", type=int, default=10**9)
    parser.add_argument("--tokens-per-batch", type=int, default=4096, help="padded tokens per step")
    parser.add_argument("--max-len", type=int, default=2048,
                        help="prompt is left-truncated to fit; cover the longest contexts so RoPE positions seen at use were trained")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--min-lr-frac", type=float, default=0.05)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--hard-weight", type=float, default=0.0, help="weight of the hard-label CE term")
    parser.add_argument("--hidden-weight", type=float, default=1.0,
                        help="weight of the hidden-state term (the draft's final hidden state against the "
                             "target's, projected on the basis; positions without stored hidden states skip it)")
    parser.add_argument("--basis-positions", type=int, default=65536,
                        help="target hidden states sampled to fit the hidden basis")
    parser.add_argument("--full-softmax-every", type=int, default=4,
                        help="one step in N uses the full-vocabulary softmax, the others a sampled one "
                             "(1 = always full)")
    parser.add_argument("--negatives", type=int, default=4096, help="random extra columns of a sampled softmax")
    parser.add_argument("--eval-every-min", type=float, default=5.0)
    parser.add_argument("--ckpt-every-min", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=2)
    for field, default in asdict(DraftConfig()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default)
    args = parser.parse_args(argv)
    if args.embed_basis not in EMBED_BASES:
        parser.error(f"--embed-basis must be one of {', '.join(EMBED_BASES)}")
    return args



class Run:
    """One distillation run, as `build` makes it and `train` and `report` advance it: the settings,
    the data, the basis, the draft and its optimiser, and the state a checkpoint resumes (steps,
    epoch, time trained, evaluations)."""

    def __init__(self, args):
        self.args = args
        self.data_dir = Path(args.data_dir or td.default_data_dir(args.target))
        self.out_dir = Path(args.out)
        self.ckpt_path = Path(args.ckpt_dir or td.cache_dir() / "checkpoints" / self.out_dir.name) / "last.pt"
        self.cfg = DraftConfig(**{f: getattr(args, f) for f in asdict(DraftConfig())})
        self.manifest = td.read_manifest(self.data_dir)
        self.train, self.heldout = [], []
        self.n_train_tokens = self.n_hidden_tokens = 0
        self.tokenizer, self.pad_id = None, 0
        self.basis = self.basis_check = self.init_card = None
        self.draft = self.optimizer = None
        self.state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "elapsed_s": 0.0, "evals": [], "tokens_seen": 0}

    def save_checkpoint(self) -> None:
        a = self.args
        self.ckpt_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": self.draft.state_dict(), "optimizer": self.optimizer.state_dict(), "state": self.state,
                    "config": asdict(self.cfg), "runs": a.runs, "init": a.init,
                    "init_layers": a.init_layers, "basis": self.basis},
                   self.ckpt_path.with_suffix(".tmp"))
        os.replace(self.ckpt_path.with_suffix(".tmp"), self.ckpt_path)

    def evaluate(self) -> None:
        if not self.heldout:
            return
        result = {"step": self.state["step"], "minutes": round(self.state["elapsed_s"] / 60, 1),
                  **agreement(self.draft, self.heldout, self.pad_id)}
        self.state["evals"].append(result)
        tqdm.write(f"eval step {result['step']}: top1 {result['top1']:.3f} top4 {result['top4']:.3f}")


def build(args) -> Run:
    """The data (fitting-split runs to train on, the held-out run to evaluate), the draft on its basis
    (new, or --init's), its optimiser, and a checkpoint of the same run resumed."""
    torch.set_num_threads(args.threads)
    run = Run(args)
    _read_data(run)
    embedding_dirs, E = _basis(run)
    run.draft = build_draft(run.target, run.cfg, run.basis if run.basis is not None else embedding_dirs)
    _check_basis(run, embedding_dirs, E)
    del run.target
    if args.init:
        _continue_from(run)
    decay = [p for n, p in run.draft.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in run.draft.named_parameters() if p.dim() < 2]
    run.optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )
    _resume(run)
    return run


def _read_data(run: Run) -> None:
    """Fitting-split runs for training (shard by shard: a teacher pass that stored several layers holds
    ~3.5 KB a position, of which a sequence keeps the final state only), the held-out greedy run for
    evaluation."""
    args = run.args
    for name in args.runs:
        if run.manifest["runs"][name]["settings"].get("split") in ("heldout", "all"):
            raise td.DataError(f"run {name!r} contains held-out prompts; train on the fitting split only")
    need_hidden = args.hidden_weight > 0 or (args.embed_basis == "hidden" and not args.init)
    stream = td.ShardedExamples(run.data_dir, args.runs, with_hidden="optional" if need_hidden else False)
    run.train = [make_sequence(e, args.max_len) for unit in stream.units for e in stream.load([unit])]
    run.n_train_tokens = sum(len(s["next_ids"]) for s in run.train)
    run.n_hidden_tokens = sum(len(s["hidden"]) for s in run.train if s["hidden"] is not None)
    if need_hidden and run.n_hidden_tokens == 0:
        raise td.DataError("no run given has stored hidden states: generate one with --store-hidden or run "
                           "`target_data.py teacher <run> --store-hidden`, or pass --hidden-weight 0 --embed-basis "
                           "embedding")
    if args.heldout_run:
        run.heldout = [make_sequence(e, args.max_len) for e in td.load_examples(run.data_dir, [args.heldout_run])]
    print(f"train: {len(run.train)} sequences, {run.n_train_tokens} response tokens "
          f"({run.n_hidden_tokens} with target hidden states); heldout: {len(run.heldout)} sequences")


def _basis(run: Run):
    """The target (kept on `run` until the draft is built), its tokenizer and padding id, and the basis
    the draft's embedding is built on: --init's own, the target's final hidden states' principal
    directions, or its embedding's singular directions. Returns (the embedding's directions, the
    target's embedding)."""
    args, cfg = run.args, run.cfg
    run.target, run.tokenizer = td.load_target(args.target, device="cpu", dtype=torch.float32)
    # padding is masked out; any id will do when the tokenizer names none
    run.pad_id = next((i for i in (run.tokenizer.pad_token_id, run.tokenizer.eos_token_id) if i is not None), 0)
    E = run.target.get_input_embeddings().weight.detach().float()  # (V, C_target)
    embedding_dirs = hidden_basis(E, cfg.hidden_size)
    if args.init:
        # a continued draft keeps the basis its embedding was built from
        if (Path(args.init) / BASIS_FILE).exists():
            run.basis = load_basis(Path(args.init) / BASIS_FILE)
        elif args.hidden_weight > 0:
            raise td.DataError(f"--init {args.init} has no {BASIS_FILE} (it was built before hidden-state "
                               f"training): pass --hidden-weight 0")
    elif args.embed_basis == "hidden":
        run.basis = hidden_basis(sample_hidden(run.train, args.basis_positions)[0], cfg.hidden_size)
    else:
        run.basis = embedding_dirs
    # a continued draft without a basis file is built on any basis: --init overwrites its weights
    return embedding_dirs, E


def _check_basis(run: Run, embedding_dirs, E) -> None:
    """How often the target's top-1 survives its final hidden state kept to the basis, on other
    positions than the basis was fitted on (another seed), against the embedding's own basis."""
    if run.basis is None or not run.n_hidden_tokens:
        return
    hidden, top1 = sample_hidden(run.train, 4096, seed=1)
    run.basis_check = {"positions": len(top1), "target_top1_kept": {
        "this draft's basis": round(basis_top1(E, run.basis, hidden, top1), 4),
        "top singular directions of the embedding": round(basis_top1(E, embedding_dirs, hidden, top1), 4)}}
    print(f"target top-1 kept on the basis: {run.basis_check['target_top1_kept']}")


def _continue_from(run: Run) -> None:
    """--init's weights in the draft (its --init-layers where it is deeper), and its card."""
    from transformers import AutoModelForCausalLM

    args, cfg = run.args, run.cfg
    source = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32)
    source_state, source_layers = source.state_dict(), source.config.num_hidden_layers
    if args.init_layers is not None or source_layers != cfg.num_hidden_layers:
        if len(args.init_layers or ()) != cfg.num_hidden_layers:
            raise td.DataError(f"--init {args.init} has {source_layers} layers and the draft {cfg.num_hidden_layers}: "
                               f"pass --init-layers with the {cfg.num_hidden_layers} of its layers to keep")
        try:
            source_state = select_layers(source_state, args.init_layers, source_layers)
        except ValueError as exc:
            raise td.DataError(f"--init-layers: {exc}") from None
    try:
        run.draft.load_state_dict(source_state)
    except RuntimeError as exc:
        raise td.DataError(f"--init {args.init} does not match the draft architecture given: "
                           f"{str(exc)[:300]}") from None
    card_file = Path(args.init) / "card.json"
    run.init_card = json.loads(card_file.read_text()) if card_file.exists() else {}
    print(f"starting from {args.init}")


def _resume(run: Run) -> None:
    """A checkpoint of the same config, runs and --init picked up where it stopped."""
    args = run.args
    if not run.ckpt_path.exists():
        return
    ckpt = torch.load(run.ckpt_path, weights_only=False)
    if (ckpt["config"] != asdict(run.cfg) or ckpt["runs"] != args.runs or ckpt.get("init") != args.init
            or ckpt.get("init_layers") != args.init_layers):
        raise td.DataError(f"checkpoint {run.ckpt_path} is for another config or data; move it away to start over")
    run.draft.load_state_dict(ckpt["model"])
    run.basis = ckpt.get("basis", run.basis)  # the one the run started with
    run.optimizer.load_state_dict(ckpt["optimizer"])
    run.state = ckpt["state"]
    print(f"resumed at step {run.state['step']} ({run.state['elapsed_s'] / 60:.1f} min trained)")


def train(run: Run) -> None:
    """Steps until the time budget or --max-steps, epochs over length-bucketed batches; an evaluation
    and a checkpoint every few minutes (their time is not training time), both again at the end."""
    args, state, draft = run.args, run.state, run.draft
    budget_s = args.time_budget_min * 60
    draft.train()
    bar = tqdm(total=int(budget_s), initial=int(state["elapsed_s"]), desc="distill", unit="s", dynamic_ncols=True)
    last_eval = last_ckpt = state["elapsed_s"]
    if state["step"] == 0:
        run.evaluate()
    t_prev = time.time()
    while state["elapsed_s"] < budget_s and state["step"] < args.max_steps:
        batches = make_batches(run.train, args.tokens_per_batch, shuffle=True, seed=state["epoch"])
        for batch in batches[state["batch_in_epoch"]:]:
            # lr: linear warmup, then cosine over the *time* budget, so any
            # budget gets a full decay
            progress = min(state["elapsed_s"] / budget_s, 1.0)
            lr = args.lr * min(1.0, (state["step"] + 1) / args.warmup_steps)
            lr *= args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))
            loss, tokens = _step(run, batch, lr)

            now = time.time()
            state["elapsed_s"] += now - t_prev
            t_prev = now
            state["step"] += 1
            state["batch_in_epoch"] += 1
            state["tokens_seen"] += tokens
            bar.update(int(state["elapsed_s"]) - bar.n)
            bar.set_postfix(step=state["step"], epoch=state["epoch"], loss=f"{loss.item():.3f}", lr=f"{lr:.1e}")
            if state["elapsed_s"] - last_eval >= args.eval_every_min * 60:
                run.evaluate()
                last_eval = state["elapsed_s"]
            if state["elapsed_s"] - last_ckpt >= args.ckpt_every_min * 60:
                run.save_checkpoint()
                last_ckpt = state["elapsed_s"]
            t_prev = time.time()  # eval and checkpoint time is not training time
            if state["elapsed_s"] >= budget_s or state["step"] >= args.max_steps:
                break
        else:
            state["epoch"] += 1
            state["batch_in_epoch"] = 0
    bar.close()
    run.evaluate()
    run.save_checkpoint()


def _step(run: Run, batch: list[int], lr: float):
    """One optimiser step on the sequences `batch` at learning rate `lr`: the soft labels' cross-entropy
    (over the full vocabulary one step in --full-softmax-every, else a sampled one), plus the hidden-state
    term where stored. Returns (loss, label tokens)."""
    args, draft = run.args, run.draft
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    data = collate([run.train[i] for i in batch], run.pad_id)
    topk_ids, next_ids, vocab = data["topk_ids"], data["next_ids"], None
    if args.full_softmax_every > 1 and run.state["step"] % args.full_softmax_every != 0:
        vocab, topk_ids, next_ids = sampled_vocab(topk_ids, next_ids, draft.config.vocab_size, args.negatives)
    hidden = label_hidden(draft, data)
    loss = distill_loss(head_logits(draft, hidden, vocab), topk_ids, data["topk_probs"], next_ids, args.hard_weight)
    if args.hidden_weight > 0 and "hidden" in data:
        loss = loss + args.hidden_weight * hidden_loss(hidden[data["hidden_at"]], data["hidden"], run.basis)
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
    run.optimizer.step()
    return loss, len(next_ids)


def report(run: Run, argv=None) -> None:
    """The draft written to --out in bfloat16 with its tokenizer, basis and card (architecture, data,
    labels, training, evaluations, the command)."""
    args, cfg, state, draft, basis = run.args, run.cfg, run.state, run.draft, run.basis
    command = "python tools/distill_draft.py " + " ".join(sys.argv[1:] if argv is None else argv)
    settings = run.manifest["runs"]
    export_draft(draft, run.out_dir, run.tokenizer, {
        "name": run.out_dir.name,
        "description": "Standalone draft model for SmolLM2-135M-Instruct, trained by self-distillation "
                       "on text the target generated (tools/target_data.py, tools/distill_draft.py).",
        "target": "HuggingFaceTB/SmolLM2-135M-Instruct (local copy: " + Path(args.target).name + ")",
        "architecture": {"class": "LlamaForCausalLM", **asdict(cfg), "vocab_size": draft.config.vocab_size,
                         "tie_word_embeddings": True, "dtype": "bfloat16",
                         "init": (f"the weights of {args.init}"
                                  + (f", keeping its layers {args.init_layers}" if args.init_layers else "")
                                  + " (see training.continued_from)" if args.init else
                                  f"embedding = target embedding projected on the top-{cfg.hidden_size} "
                                  + ("principal directions (uncentred) of the target's final hidden states, "
                                     f"from {args.basis_positions} positions of the training runs "
                                     f"({BASIS_FILE})" if cfg.embed_basis == "hidden" else
                                     "singular directions of the target's embedding")
                                  + "; layers random")},
        "parameters": n_params(draft),
        "training": {
            "data": {run: {"settings": settings[run]["settings"], "sequences": settings[run].get("n_sequences"),
                           "response_tokens": settings[run].get("n_tokens"),
                           "generation_minutes": round(settings[run].get("seconds", 0) / 60, 1),
                           "commands": settings[run].get("commands", [])}
                     for run in args.runs},
            "response_tokens": run.n_train_tokens,
            "prompts": "those of the runs under data: Spec-Bench first turns with question_id % 5 != 0, prompts "
                       "the target wrote from those (self-instruct) or from its chat template alone (Magpie, "
                       "runs read from the token store); no held-out Spec-Bench prompt was used",
            "labels": "target top-8 next-token probabilities (soft cross-entropy, renormalised)"
                      + (f" + {args.hard_weight} x hard cross-entropy" if args.hard_weight else "")
                      + (f" + {args.hidden_weight} x relative squared error of the final hidden state against "
                         "the target's, projected on the embedding's basis (where stored)"
                         if args.hidden_weight > 0 and basis is not None else ""),
            "positions_with_target_hidden": run.n_hidden_tokens if args.hidden_weight > 0 else 0,
            **({"basis_check": {**run.basis_check, "what": "how often the target's top-1 token survives keeping "
                                "its final hidden state to the basis (the most a draft predicting that "
                                "projection could agree), on stored training-text positions"}}
               if run.basis_check else {}),
            "steps": state["step"], "epochs": round(state["tokens_seen"] / max(run.n_train_tokens, 1), 2),
            "tokens_per_batch": args.tokens_per_batch, "lr": args.lr, "max_len": args.max_len,
            "softmax": f"full every {args.full_softmax_every} steps, otherwise over the batch's label tokens "
                       f"+ {args.negatives} random negatives",
            "train_minutes": round(state["elapsed_s"] / 60, 1), "threads": args.threads,
            "evals": state["evals"],
            **({"continued_from": {"model": args.init, "training": run.init_card.get("training", {}),
                                   "command": run.init_card.get("command")}} if args.init else {}),
        },
        "command": command,
    }, basis=basis)
    print(f"wrote {run.out_dir}")
