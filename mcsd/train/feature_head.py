"""Train a target-feature draft head (mcsd.drafting.feature_draft.FeatureHead) on target-written data.

Data come from tools/target_data.py: responses the target wrote to the
fitting split (and to self-instruct prompts) with, per response position, the
target's final hidden state and its top-k next-token distribution, stored as
it generates (or by a teacher-forced pass, for text it did not generate):

    python tools/target_data.py generate --run fit-greedy --split fit --store-hidden
    python tools/target_data.py generate --run heldout-greedy --split heldout --store-hidden
    python tools/train_feature_drafter.py --runs fit-greedy --heldout-run heldout-greedy --time-budget-min 30

Training, per response position t (hidden[t] is the target feature that
predicts response[t]):
- step 1 reads (hidden[t], emb(response[t])) and must predict hidden[t+1]
  (smooth-L1 regression) and the target's distribution of response[t+1]
  (cross-entropy to the renormalised top-k, over the head's sub-vocabulary);
- steps 2..K read the head's *own* previous predictions in place of hidden
  (unrolled, as the head runs deeper in a tree), each predicting one more
  token ahead. A head trained only on true features collapses from step 2 on.
  Each step attends to the true-feature entries of step 1 up to its chain's
  root and to its own chain's earlier steps (`unroll`), the context a drafted
  node has in decoding, so the teacher-forced chain from a position is what a
  decoding round rooted there accepts (tests/test_feature_training.py).

The sub-vocabulary is the `--sub-vocab` most frequent tokens among the
fitting responses and their top-k labels; label mass outside it is dropped.
Checkpoints go to the mcsd cache every few minutes and a killed run resumes.
Data larger than memory is read a chunk at a time (`--resident-positions`):
each epoch visits the runs' label shards in a new random order, and a
killed run resumes at the chunk it was in. With `--store` the runs are token
runs of a shard store (the repository's data/<target>/), which the target
labels a chunk at a time on the training device as they are read
(`mcsd.train.online`): no teacher stage, nothing written.
The final head (safetensors + JSON config + card) goes to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from mcsd.drafting.feature_draft import FeatureHead, FeatureHeadConfig, default_feature_layers
from mcsd.drafting.pair import load_model
from mcsd.loading.cache import cache_dir
from mcsd.train import data as target_data
from mcsd.train import portable
from mcsd.train.eagle3_export import new_eagle3_head, write_speculators
from mcsd.train.engine import TOPK, padding_id
from mcsd.train.online import OnlineExamples


def sub_vocabulary(examples: list[dict], size: int, vocab: int) -> torch.Tensor:
    """Frequency-ranked token ids (responses and their top-k labels), sorted ascending."""
    counts: Counter = Counter()
    for ex in examples:
        counts.update(ex["response"].tolist())
        counts.update(ex["topk_ids"].flatten().tolist())
    ids = [t for t, _ in counts.most_common(size)]
    return torch.tensor(sorted(ids[:size] if len(ids) >= size else ids), dtype=torch.long).clamp(max=vocab - 1)


def windows(examples: list[dict], length: int) -> list[tuple[int, int]]:
    """(example index, start) pairs covering every response in windows of `length` positions."""
    out = []
    for i, ex in enumerate(examples):
        r = len(ex["response"])
        out.extend((i, s) for s in range(0, max(r - 1, 1), length))
    return out


def batch(examples, items, length, device):
    """Stack windows: hidden (B, L, H), the head's inputs (B, L, L'*H: the stored target layers of a v2
    head, else the hidden states again), tokens (B, L), topk ids/probs (B, L, k), valid (B, L), positions."""
    h_dim = examples[items[0][0]]["hidden"].shape[1]
    v2 = "layers" in examples[items[0][0]]
    in_dim = examples[items[0][0]]["layers"].shape[1] if v2 else h_dim
    k = examples[items[0][0]]["topk_ids"].shape[1]
    B = len(items)
    at = examples[items[0][0]]["hidden"].device           # examples labelled on the device are stacked there
    hid = torch.zeros(B, length, h_dim, device=at)
    inp = torch.zeros(B, length, in_dim, device=at) if v2 else hid
    tok = torch.zeros(B, length, dtype=torch.long, device=at)
    ids = torch.zeros(B, length, k, dtype=torch.long, device=at)
    probs = torch.zeros(B, length, k, device=at)
    valid = torch.zeros(B, length, dtype=torch.bool, device=at)
    pos = torch.zeros(B, length, dtype=torch.long, device=at)
    for b, (i, s) in enumerate(items):
        ex = examples[i]
        n = min(length, len(ex["response"]) - s)
        hid[b, :n] = ex["hidden"][s:s + n].float()
        if v2:
            inp[b, :n] = ex["layers"][s:s + n].float()
        tok[b, :n] = ex["response"][s:s + n].long()
        ids[b, :n] = ex["topk_ids"][s:s + n].long()
        probs[b, :n] = ex["topk_probs"][s:s + n].float()
        valid[b, :n] = True
        pos[b, :n] = torch.arange(len(ex["prompt"]) + s, len(ex["prompt"]) + s + n, device=at)
    hid = hid.to(device)
    return hid, inp.to(device) if v2 else hid, tok.to(device), ids.to(device), probs.to(device), valid.to(device), pos.to(device)


def chain_mask(length: int, spans: list[int], dtype: torch.dtype, device) -> torch.Tensor:
    """The additive attention mask of unrolled step j = len(spans) - 1 >= 1 (`unroll`).

    Keys are every step's entries so far: step 1's `length` (= spans[0])
    entries (true features), then `spans[1]` entries of step 2, ..., `spans[j]`
    of step j.
    Entry t of step j (the chain rooted at t, j nodes deep) sees step 1's
    entries up to t and its own chain's entries of steps 2..j, as the drafted
    node it stands for sees the committed cache and its ancestors in a tree.

    Returns:
        (1, 1, spans[j], length + sum(spans[1:])) float, 0 where visible.
    """
    q = spans[-1]
    t = torch.arange(q, device=device)
    parts = [torch.arange(length, device=device)[None, :] <= t[:, None]]               # step 1: entries <= t
    parts += [torch.arange(span, device=device)[None, :] == t[:, None] for span in spans[1:]]  # own chain only
    allowed = torch.cat(parts, dim=1)
    out = torch.zeros(1, 1, q, allowed.shape[1], dtype=dtype, device=device)
    return out.masked_fill_(~allowed, torch.finfo(dtype).min)


def unroll(head, embed, inp, tok, pos, steps: int):
    """Run the head `steps` steps deep from every entry of a batch of windows, as it drafts.

    Step 1 reads (f_t, token t) for every entry t (true features, causal);
    step j reads step j-1's predicted feature and token t+j-1, and attends to
    step 1's entries up to t and its own chain's earlier steps (`chain_mask`),
    through one KV cache that grows by a step at a time: the context a drafted
    node has in decoding, where the committed positions' entries come from
    true features and only its ancestors' from predictions.

    Yields:
        (j, span, pred): step j = 0.., its entries 0..span-1, predicted features (B, span, H)
        of the entries' next positions (entry t of step j predicts position t+j+1's feature).
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    feats = head.fused(inp)
    spans = []
    for j in range(steps):
        span = inp.shape[1] - 1 - j                        # entries with a target j+1 positions ahead
        if span <= 0:
            return
        spans.append(span)
        mask = None if j == 0 else chain_mask(spans[0], spans, feats.dtype, feats.device)
        pred = head(feats[:, :span], embed(tok[:, j:j + span]), pos[:, j:j + span], mask, cache)
        yield j, span, pred
        feats = pred


def unrolled_loss(head, embed, hid, inp, tok, ids, probs, valid, pos, steps: int, slot, feat_weight: float):
    """Loss over `steps` unrolled steps (`unroll`), and per-step top-1 agreement counts.

    Entry t reads (f_t, emb(tok[t])) at position pos[t] (the token's own
    position) and predicts f_{t+1}; its scores are matched to the target's
    distribution at t+1. Every step predicts the final state.
    """
    total = hid.new_zeros(())
    stats = []
    for j, span, pred in unroll(head, embed, inp, tok, pos, steps):
        want_f = hid[:, 1 + j:1 + j + span]
        m = valid[:, 1 + j:1 + j + span] & valid[:, j:j + span]
        lab_ids, lab_p = ids[:, 1 + j:1 + j + span], probs[:, 1 + j:1 + j + span]
        in_sub = slot[lab_ids] >= 0
        lab_p = torch.where(in_sub, lab_p, 0.0)
        lab_p = lab_p / lab_p.sum(-1, keepdim=True).clamp_min(1e-6)
        logq = torch.log_softmax(head.sub_scores(pred), dim=-1)                       # (B, span, K)
        ce = -(lab_p * logq.gather(-1, slot[lab_ids].clamp_min(0))).sum(-1)
        reg = F.smooth_l1_loss(pred, want_f, reduction="none").mean(-1)
        step_loss = ((ce + feat_weight * reg) * m).sum() / m.sum().clamp_min(1)
        total = total + step_loss * (0.8 ** j)
        top1 = head.vocab_ids[logq.argmax(-1)]
        stats.append((int(((top1 == lab_ids[..., 0]) & m).sum()), int(m.sum())))
    return total, stats


def _chain_steps(head, embed, hid, inp, tok, ids, valid, pos, steps):
    """Per unrolled step j = 1..steps (`unroll`), for the chain drafted from every entry of one
    window: (top-1 right (1, span), target token in the top 4 (1, span), entry counted (1, span)).
    The stored features are read in the head's own dtype (a bfloat16 head, as a bfloat16 target loads it)."""
    inp = inp.to(next(head.parameters()).dtype)
    for j, span, pred in unroll(head, embed, inp, tok, pos, steps):
        m = valid[:, 1 + j:1 + j + span] & valid[:, j:j + span]
        want = ids[:, 1 + j:1 + j + span, 0]
        top4 = head.vocab_ids[head.sub_scores(pred).topk(4, dim=-1).indices]
        yield (top4[..., 0] == want) & m, (top4 == want[..., None]).any(-1) & m, m


@torch.no_grad()
def agreement(head, embed, examples, length, device, steps=3):
    """Teacher-forced agreement with the target's greedy token at steps 1..steps (`_chain_steps`).

    `top1` and `top4` count every entry; `top1_given_prev` counts only the
    entries whose steps 1..j-1 were all top-1 right, which is what a chain's
    acceptance at depth j measures in real greedy decoding (a depth is
    verified only where the depths above it were accepted), so the two compare.
    """
    head.eval()
    hits1, hits4, n = [0] * steps, [0] * steps, [0] * steps
    cond_hits, cond_n = [0] * steps, [0] * steps
    for i in range(len(examples)):
        for start in range(0, max(len(examples[i]["response"]) - 1, 1), length):
            hid, inp, tok, ids, _, valid, pos = batch(examples, [(i, start)], length, device)
            chain_ok = valid                                         # (1, L): the steps so far all right
            for j, (right, in_top4, m) in enumerate(_chain_steps(head, embed, hid, inp, tok, ids, valid, pos, steps)):
                reached = chain_ok[:, :right.shape[1]] & m
                hits1[j] += int(right.sum())
                hits4[j] += int(in_top4.sum())
                n[j] += int(m.sum())
                cond_hits[j] += int((right & reached).sum())
                cond_n[j] += int(reached.sum())
                chain_ok = right & reached
    head.train()
    return [{"step": j + 1, "top1": hits1[j] / max(n[j], 1), "top4": hits4[j] / max(n[j], 1), "positions": n[j],
             "top1_given_prev": cond_hits[j] / max(cond_n[j], 1), "positions_reached": cond_n[j]}
            for j in range(steps)]


@torch.no_grad()
def chain_lengths(head, embed, example: dict, steps: int = 3, device="cpu") -> torch.Tensor:
    """Teacher-forced, for every response position t of one example: how many of the `steps` tokens
    after it a chain drafted from t gets right in a row (what real greedy decoding accepts in a
    round rooted there). Positions whose chain runs past the response hold what fits.

    Returns:
        (R,) long, R the response length.
    """
    r = len(example["response"])
    hid, inp, tok, ids, _, valid, pos = batch([example], [(0, 0)], r, device)
    run = torch.zeros(1, r, dtype=torch.long, device=hid.device)
    alive = torch.ones(1, r, dtype=torch.bool, device=hid.device)
    for right, _, _ in _chain_steps(head, embed, hid, inp, tok, ids, valid, pos, steps):
        span = right.shape[1]
        alive[:, :span] &= right
        alive[:, span:] = False
        run += alive.long()
    return run[0]


def run_provenance(data_dir: Path, runs: list[str]) -> dict:
    """Per run: its settings, size, generation time, the commands that wrote it and, for corpus runs,
    the sources' provenance (from the manifest)."""
    manifest = target_data.read_manifest(Path(data_dir))
    out = {}
    for run in runs:
        entry, teacher = target_data.response_run(manifest, run, data_dir), manifest["teacher"].get(run)
        out[run] = target_data.run_summary(entry)
        if entry.get("provenance"):              # a corpus run: per source, version, licence and size
            out[run]["sources"] = entry["provenance"]
        if teacher:
            out[run]["teacher"] = {"settings": teacher["settings"], "minutes": round(teacher.get("seconds", 0) / 60, 1),
                                   "commands": teacher.get("commands", [])}
    return out


def _curve_point(card: dict, head: str) -> dict:
    return {"positions": card["data"]["positions"], "subset": card["data"].get("subset", 1.0),
            "positions_seen": card["training"]["positions_seen"], "head": head,
            "agreement": card["heldout_agreement"]}


def data_size_curve(card: dict, subset_dirs: list[Path], init_card: dict | None = None) -> list[dict]:
    """Held-out agreement against training positions: the subset heads' cards, the head this one
    continued from (trained on less data) and this head (`card`)."""
    points = [_curve_point(json.loads((d / "card.json").read_text()), str(d)) for d in subset_dirs]
    points += [_curve_point(c, head) for c, head in ((init_card, "--init head"), (card, "this head"))
               if c and c.get("heldout_agreement")]
    return sorted(points, key=lambda p: p["positions"])


def main(argv=None) -> int:
    """Parse, build (the target, the data, the head), train, report (held-out agreement, the card,
    the head written); a mistake in the data or the settings ends it with one line."""
    args = parse_args(argv)
    try:
        run = build(args)
        train(run)
        report(run, argv)
    except target_data.DataError as exc:
        sys.exit(str(exc))
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="target source (default: the embedded preset)")
    ap.add_argument("--data-dir", type=Path, default=None, help="target_data.py folder")
    ap.add_argument("--runs", nargs="+", required=True,
                    help="response runs with hidden states (generated or teacher-labelled with --store-hidden)")
    ap.add_argument("--heldout-run", default=None, help="run on held-out prompts, for agreement")
    ap.add_argument("--store", type=Path, default=None,
                    help="read --runs and --heldout-run as token runs of this shard store (the repository's "
                         "data/<target>/) and label them with the target a chunk at a time as training reads "
                         "them (top-k and the layers the head reads, on the training device, nothing written): "
                         "no teacher stage; the way to train on a GPU, where that pass costs less than reading "
                         "stored labels back; needs --resident-positions (a chunk holds about 14 KB a position "
                         "on the device for a head reading three 576-wide layers: labels, and its windows stacked)")
    ap.add_argument("--teacher-dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                    help="with --store: the labelling target's dtype (auto: bfloat16 on CUDA, float32 elsewhere)")
    ap.add_argument("--teacher-topk", type=int, default=TOPK, help="with --store: the target's top-k kept a position")
    ap.add_argument("--teacher-tokens", type=int, default=65536,
                    help="with --store: padded tokens a labelling batch")
    ap.add_argument("--out", type=Path, default=Path("models/smollm2-135m-feature-head"))
    ap.add_argument("--init", type=Path, default=None,
                    help="start from this saved head (its architecture and sub-vocabulary), e.g. to go on "
                         "training a shipped head on new data; the size options below are then ignored, and "
                         "--feature-layers with -1 among them widens a v1 head to a v2 one that starts out "
                         "drafting exactly as it did")
    ap.add_argument("--arch", choices=("mcsd", "eagle3"), default="mcsd",
                    help="mcsd: this project's head (no MLP, scored by the target's LM head rows); eagle3: "
                         "EAGLE-3's (fc over three target layers, a decoder layer with an MLP, its own LM head "
                         "over the sub-vocabulary), written in the speculators layout that vLLM serves "
                         "(tools/export_eagle3.py writes the original layout for SGLang); it reads "
                         "--feature-layers (default EAGLE-3's 2, L/2, L-3), and --hidden does not apply")
    ap.add_argument("--verifier", default=None,
                    help="with --arch eagle3: the target's name as vLLM will find it, written into the head's "
                         "config (default: --target)")
    ap.add_argument("--hidden", type=int, default=0, help="head width (0 = the target's)")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--feature-layers", default="",
                    help="v2: the target hidden states the head reads, e.g. 2,15,27 (the runs must hold them: "
                         "tools/target_data.py teacher RUN --store-layers 2,15,27); default: the final state (v1)")
    ap.add_argument("--sub-vocab", type=int, default=8192)
    ap.add_argument("--steps-unrolled", type=int, default=3)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--feat-weight", type=float, default=1.0)
    ap.add_argument("--subset", type=float, default=1.0,
                    help="train on this fraction of the prompts (all their responses), for learning curves "
                         "against data size")
    ap.add_argument("--curve-from", type=Path, nargs="*", default=[],
                    help="heads trained with --subset: their data size and held-out agreement go on this "
                         "head's card as the learning curve against data size")
    ap.add_argument("--resident-positions", type=int, default=0,
                    help="hold about this many training positions in memory at a time (0 = all): every epoch "
                         "reads the runs' label shards in a new random order, a chunk of this size at a time, "
                         "and shuffles windows within the chunk (a new head's sub-vocabulary is ranked on the "
                         "first chunk); for data larger than memory, about 3.5 KB a position for a head "
                         "reading three target layers")
    ap.add_argument("--time-budget-min", type=float, default=30.0)
    ap.add_argument("--max-updates", type=int, default=0, help="stop after this many updates (0 = time only)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16", action="store_true",
                    help="run the head's products in bfloat16 (autocast; weights and optimiser stay float32): "
                         "several times faster on CPUs with AMX or AVX512-BF16 and on GPUs, slower elsewhere")
    return ap.parse_args(argv)


class Run:
    """One training run, as `build` makes it and `train` and `report` advance it: the settings, the
    target, the data (in memory, or streamed a chunk at a time), the head and its optimiser, and the
    counts (updates, positions seen, epoch and chunk) a checkpoint resumes."""

    def __init__(self, args, device: str, target):
        self.args, self.device, self.target, self.t_start = args, device, target, time.time()
        self.embed = target.get_input_embeddings()
        self.data_dir = args.data_dir or target_data.default_data_dir(args.target or target_data.DEFAULT_TARGET)
        self.eagle3 = args.arch == "eagle3"
        self.feature_layers, self.saved, self.widen = (), None, False
        self.stream, self.train, self.held, self.keep = None, [], [], None
        self.head = self.opt = self.params = self.slot = None
        self.init_card, self.curve = None, []
        self.update = self.seen = self.epoch = self.chunk = 0
        self.responses = self.positions = 0

    @property
    def width(self) -> int:
        return self.target.config.hidden_size * len(self.feature_layers)

    def prepare(self, examples: list[dict], subset: bool = True) -> list[dict]:
        """The examples (of the chosen subset), with the stored inputs this head reads."""
        if subset and self.keep is not None:
            examples = [e for e in examples if e["prompt_id"] in self.keep]
        for ex in examples:
            if not self.feature_layers:
                ex.pop("layers", None)                    # v1 reads the final state only
            elif "layers" not in ex or ex["layers"].shape[1] != self.width:
                raise target_data.DataError(
                    f"--feature-layers {self.args.feature_layers or list(self.feature_layers)} needs the runs' "
                    f"stored target layers ({self.width} values a position); run tools/target_data.py teacher RUN "
                    f"--store-layers {','.join(map(str, self.feature_layers))}")
        return examples

    def checkpoint(self) -> Path:
        return cache_dir() / "train" / f"{self.args.out.name}.pt"

    def run_key(self) -> dict:
        """What a checkpoint must match to be resumed."""
        a = self.args
        return {"config": self.head.cfg.__dict__, "runs": a.runs, "init": str(a.init), "subset": a.subset,
                "resident_positions": a.resident_positions, "store": str(a.store) if a.store else None}


def build(args) -> Run:
    """The target, the layers the head reads, the data, the head (new, continued or widened), its
    optimiser, and a checkpoint of the same run resumed."""
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t_start = time.time()                        # the time budget counts the target's loading too
    run = Run(args, device, load_model(args.target or "smollm2-135m", dtype="float32", device=device))
    run.t_start = t_start
    _choose_layers(run)
    _read_data(run)
    _make_head(run)
    _resume(run)
    return run


def _choose_layers(run: Run) -> None:
    """The target layers the head reads: --feature-layers, an EAGLE-3 head's default, or --init's
    (a v1 head may widen to layers that include -1); checked against what the runs store."""
    args, target = run.args, run.target
    feature_layers = tuple(int(x) for x in args.feature_layers.split(",") if x.strip())
    if run.eagle3:
        n_layers = target.config.num_hidden_layers
        feature_layers = feature_layers or default_feature_layers(n_layers)
        if args.init is not None:
            raise target_data.DataError("--arch eagle3 trains a new head; --init goes on from mcsd heads only")
        ids = list(feature_layers)
        if len(ids) != 3 or ids != sorted(set(ids)) or not all(0 <= i < n_layers for i in ids):
            raise target_data.DataError(
                f"an EAGLE-3 head reads three distinct target layers among 0..{n_layers - 1} (layer inputs) in "
                f"ascending order, the order vLLM and SGLang concatenate them in; not {list(feature_layers)}")
        args.feat_weight = 0.0               # its outputs are not the target's features: scores alone train it
    saved = FeatureHead.load(args.init) if args.init is not None else None
    widen = saved is not None and not saved.cfg.feature_layers and bool(feature_layers)
    if saved is not None and not widen:
        if feature_layers and feature_layers != saved.cfg.feature_layers:
            raise target_data.DataError(f"{args.init} reads target layers {list(saved.cfg.feature_layers)}, not "
                                        f"{list(feature_layers)}; only a v1 head widens to other layers")
        feature_layers = saved.cfg.feature_layers
    if widen and -1 not in feature_layers:
        raise target_data.DataError(f"a v1 head (--init {args.init}) widens to layers that include -1, the final "
                                    f"state it reads")
    if feature_layers and args.store is None:
        manifest = target_data.read_manifest(Path(run.data_dir))
        for name in args.runs + ([args.heldout_run] if args.heldout_run else []):
            stored = (manifest["teacher"].get(name) or {}).get("settings", {}).get("store_layers")
            if stored is not None and tuple(stored) != feature_layers:
                raise target_data.DataError(f"run {name!r} stores target layers {stored}, not {list(feature_layers)}")
    run.feature_layers, run.saved, run.widen = feature_layers, saved, widen


def _read_data(run: Run) -> None:
    """The training examples (all, or the first chunk of a stream) and the held-out ones: from the data
    dir, or a shard store's token runs labelled by the target as they are read (--store); the subset."""
    args, device = run.args, run.device
    if args.store is not None:                   # token runs, labelled by the target as training reads them
        if args.resident_positions <= 0:
            raise target_data.DataError("--store labels the runs a chunk at a time: give --resident-positions "
                                        "(e.g. 262144)")
        teacher, tokenizer = target_data.load_target(args.target or target_data.DEFAULT_TARGET, device=device,
                                                     dtype=args.teacher_dtype)
        online = {"model": teacher, "pad_id": padding_id(tokenizer), "layers": run.feature_layers,
                  "topk": args.teacher_topk, "token_budget": args.teacher_tokens}
        try:
            run.stream = OnlineExamples(args.store, args.runs, **online)
            held_stream = OnlineExamples(args.store, [args.heldout_run], **online) if args.heldout_run else None
        except ValueError as e:
            raise target_data.DataError(str(e)) from None
        run.train = run.stream.load(run.stream.chunks(args.resident_positions, epoch=0, seed=args.seed)[0])
        run.held = held_stream.load(held_stream.units) if held_stream else []
    else:
        if args.resident_positions > 0:
            run.stream = target_data.ShardedExamples(run.data_dir, args.runs, with_hidden=True)
            run.train = run.stream.load(run.stream.chunks(args.resident_positions, epoch=0, seed=args.seed)[0])
        else:
            run.train = target_data.load_examples(run.data_dir, args.runs, with_hidden=True)
        run.held = target_data.load_examples(run.data_dir, [args.heldout_run], with_hidden=True) \
            if args.heldout_run else []
    stream = run.stream
    if args.subset < 1.0:
        prompt_ids = sorted(stream.by_prompt if stream else {e["prompt_id"] for e in run.train})
        run.keep = set(random.Random(args.seed).sample(prompt_ids, round(args.subset * len(prompt_ids))))
    prompts = stream.by_prompt if stream else {e["prompt_id"] for e in run.train}
    if not any(run.keep is None or pid in run.keep for pid in prompts):   # (not just the first streamed chunk)
        raise target_data.DataError("no training examples with hidden states; run tools/target_data.py teacher "
                                    "RUN --store-hidden first")
    run.train, run.held = run.prepare(run.train), run.prepare(run.held, subset=False)
    if stream is None:
        run.responses, run.positions = len(run.train), sum(len(e["response"]) for e in run.train)
    else:
        counts = [c for pid, c in stream.by_prompt.items() if run.keep is None or pid in run.keep]
        run.responses, run.positions = sum(n for n, _ in counts), sum(n for _, n in counts)


def _make_head(run: Run) -> None:
    """The head: --init's (continued, or widened from v1), or a new one (mcsd's or EAGLE-3's) over the
    sub-vocabulary of the first data read; its optimiser."""
    args, target, device, saved = run.args, run.target, run.device, run.saved
    vocab = target.get_output_embeddings().weight.shape[0]
    if saved is not None:
        if run.widen:                                            # v1 -> v2, drafting as before at the start
            head = saved.with_feature_layers(run.feature_layers).to(device)
        else:
            head = FeatureHead(saved.cfg).to(device)             # trainable, like a fresh head
            head.load_state_dict(saved.state_dict())             # weights and sub-vocabulary
        if head.cfg.vocab_size != vocab or head.cfg.target_hidden != target.config.hidden_size:
            raise target_data.DataError(f"{args.init} was trained for another target (vocabulary "
                                        f"{head.cfg.vocab_size}, features {head.cfg.target_hidden})")
        init_file = args.init / "card.json"
        run.init_card = json.loads(init_file.read_text()) if init_file.is_file() else {}
        print(f"starting from {args.init}" + (f", widened to target layers {list(run.feature_layers)}"
                                              if run.widen else ""))
    elif run.eagle3:
        sub = sub_vocabulary(run.train, args.sub_vocab, vocab)
        head = new_eagle3_head(target, run.feature_layers, sub, layers=args.layers).to(device)
    else:
        sub = sub_vocabulary(run.train, args.sub_vocab, vocab)
        cfg = FeatureHeadConfig(target_hidden=target.config.hidden_size, hidden=args.hidden, layers=args.layers,
                                feature_layers=run.feature_layers,
                                heads=target.config.num_attention_heads, kv_heads=target.config.num_key_value_heads,
                                rope_theta=float(getattr(target.config, "rope_theta", None)
                                                 or target.config.rope_parameters["rope_theta"]),
                                vocab_size=vocab, sub_vocab=len(sub),
                                rms_norm_eps=float(target.config.rms_norm_eps))
        head = FeatureHead(cfg).to(device)
        head.vocab_ids = sub.to(device)
    head.attach_lm_head(target.get_output_embeddings().weight)
    run.slot = torch.full((vocab,), -1, dtype=torch.long, device=device)
    run.slot[head.vocab_ids] = torch.arange(len(head.vocab_ids), device=device)
    run.head = head
    run.params = [p for p in head.parameters() if p.requires_grad]
    run.opt = torch.optim.AdamW(run.params, lr=args.lr, weight_decay=0.01)


def _resume(run: Run) -> None:
    """A checkpoint of the same run (`Run.run_key`) picked up where it stopped."""
    ckpt = run.checkpoint()
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=True)
        if all(state.get(k) == v for k, v in run.run_key().items()):
            run.head.load_state_dict(state["head"])
            run.opt.load_state_dict(state["opt"])
            run.update, run.seen = state["update"], state["seen"]
            run.epoch, run.chunk = state.get("epoch", 0), state.get("chunk", 0)
            print(f"resumed at update {run.update}" + (f" (epoch {run.epoch}, chunk {run.chunk})"
                                                        if run.stream else ""))
    print(f"{run.responses} responses, {run.positions} positions, sub-vocabulary {len(run.head.vocab_ids)}"
          + (f", read about {run.args.resident_positions} positions at a time" if run.stream else "")
          + f"; ready at {time.time() - run.t_start:.0f} s", flush=True)


def train(run: Run) -> None:
    """Updates until the time budget or --max-updates: epochs over the chunks (one, in memory, without
    a stream), windows shuffled within a chunk; a checkpoint every 5 minutes and, with held-out data,
    a learning-curve point every 500 updates."""
    args, stream, device = run.args, run.stream, run.device
    budget = args.time_budget_min * 60
    last_ckpt = time.time()
    run.head.train()
    plan, planned = [None], None                     # without a stream: one chunk, everything, in memory
    items, in_memory = windows(run.train, args.window), (0, 0)
    while True:
        if stream is not None and planned != run.epoch:
            plan, planned = stream.chunks(args.resident_positions, run.epoch, args.seed), run.epoch
        if run.chunk >= len(plan):
            run.epoch, run.chunk = run.epoch + 1, 0
            continue
        if stream is not None and (run.epoch, run.chunk) != in_memory:
            run.train = items = stacked = None       # free the last chunk before reading the next
            read = time.time()
            run.train = run.prepare(stream.load(plan[run.chunk]))
            print(f"epoch {run.epoch} chunk {run.chunk + 1}/{len(plan)}: {len(run.train)} responses read in "
                  f"{time.time() - read:.1f} s, at {time.time() - run.t_start:.0f} s", flush=True)
            items, in_memory = windows(run.train, args.window), (run.epoch, run.chunk)
        random.shuffle(items)
        # Labelled on the device: the chunk's windows stacked once, each update a slice (no per-window copies)
        stacked = batch(run.train, items, args.window, device) if args.store is not None else None
        for b in range(0, len(items), args.batch):
            elapsed = time.time() - run.t_start
            if elapsed > budget or (args.max_updates and run.update >= args.max_updates):
                break
            lr = args.lr * min(1.0, (run.update + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(elapsed / budget, 1.0)))
            windows_b = (tuple(t[b:b + args.batch] for t in stacked) if stacked is not None
                         else batch(run.train, items[b:b + args.batch], args.window, device))
            loss, stats = _update(run, windows_b, lr)
            if run.update % 50 == 0:
                acc = stats[0][0] / max(stats[0][1], 1)
                print(f"update {run.update} loss {loss.item():.3f} step-1 train top1 {acc:.3f} positions "
                      f"{run.seen} at {time.time() - run.t_start:.0f} s", flush=True)
            if time.time() - last_ckpt > 300:
                ckpt = run.checkpoint()
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                torch.save({**run.run_key(), "head": run.head.state_dict(), "opt": run.opt.state_dict(),
                            "update": run.update, "seen": run.seen, "epoch": run.epoch, "chunk": run.chunk}, ckpt)
                last_ckpt = time.time()
            if run.held and run.update % 500 == 0:
                run.curve.append({"positions_seen": run.seen,
                                  "agreement": agreement(run.head, run.embed, run.held, args.window, device)})
        else:
            run.chunk += 1
            continue
        break


def _update(run: Run, windows_b: tuple, lr: float):
    """One optimiser step on a batch of windows at learning rate `lr`; returns (loss, per-step stats)."""
    args = run.args
    for g in run.opt.param_groups:
        g["lr"] = lr
    with torch.autocast(torch.device(run.device).type, dtype=torch.bfloat16, enabled=args.bf16):
        loss, stats = unrolled_loss(run.head, run.embed, *windows_b, args.steps_unrolled, run.slot, args.feat_weight)
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(run.params, 1.0)
    run.opt.step()
    run.update += 1
    run.seen += sum(n for _, n in stats[:1])
    return loss, stats


def report(run: Run, argv=None) -> None:
    """Held-out agreement, the card (architecture, data and its provenance, training, curves, the
    command) and the head written to --out (the speculators layout for an EAGLE-3 head)."""
    args, head = run.args, run.head
    metrics = agreement(head, run.embed, run.held, args.window, run.device) if run.held else []
    for m in metrics:
        print(f"held-out step {m['step']}: top-1 {m['top1']:.3f}, top-4 {m['top4']:.3f} ({m['positions']} positions)")
    kind = "EAGLE-3 draft head" if run.eagle3 else "target-feature draft head"
    card = {"architecture": {"kind": kind, **head.cfg.__dict__},
            "parameters": sum(p.numel() for p in head.parameters() if p.requires_grad),
            "data": {"runs": run.stream.provenance() if args.store is not None
                     else run_provenance(run.data_dir, args.runs),
                     "subset": args.subset, "responses": run.responses, "positions": run.positions,
                     **({"teacher": {"online": True, "dtype": args.teacher_dtype, "topk": args.teacher_topk}}
                        if args.store is not None else {})},
            "training": {"updates": run.update, "positions_seen": run.seen, "seconds": round(time.time() - run.t_start),
                         "steps_unrolled": args.steps_unrolled, "autocast": "bfloat16" if args.bf16 else None},
            "heldout_agreement": metrics, "learning_curve": run.curve,
            "command": "python tools/train_feature_drafter.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))}
    card["data_size_curve"] = data_size_curve(card, args.curve_from, run.init_card)
    if run.init_card is not None:
        card["continued_from"] = {k: run.init_card.get(k) for k in ("data", "training", "heldout_agreement", "command",
                                                                    "continued_from") if k in run.init_card}
    if run.eagle3:                               # the layout vLLM serves, which --draft reads back
        write_speculators(head.cpu(), args.out, args.verifier or args.target or "HuggingFaceTB/SmolLM2-135M-Instruct",
                          run.target.get_input_embeddings().weight, speculative_tokens=args.steps_unrolled,
                          verifier_architectures=getattr(run.target.config, "architectures", None)
                          or ["LlamaForCausalLM"], card=portable(card))
    else:
        head.save(args.out, card=portable(card))
    print(f"wrote {args.out}")
