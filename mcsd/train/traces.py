"""Record, for every drafted node, its features and whether the target accepted it: training data for tree policies.

The engine runs with a wide static tree; the policy hooks see each level's
candidates (features as in `mcsd.drafting.policies.acceptance.candidate_features`) and,
after the one verify forward, the target's logits at every node, so every
node gets a *conditional* label, not only those on the accepted path:

- label_greedy: 1 if the node's token is the target's argmax after its parent;
- label_sampling: min(1, p(x) / q(x)) with p the target's softmax at the
  parent (temperature --label-temperature) and q(x) the draft's probability.

Output (columnar, one folder per run, resumable; no pickles):

    <out>/manifest.json          settings, groups, finished question ids, shard list
    <out>/shard-00000.npz        features      (M, D) float32, columns = manifest["features"]
                                 label_greedy  (M,) uint8
                                 label_sampling(M,) float32
                                 parent_row    (M,) int64  row of the parent node in this shard, -1 under the root
                                 question_id   (M,) int64
                                 group         (M,) int16  index into manifest["groups"]
                                 round         (M,) int64  decoding round within the question
                                 hidden        (M, H) float16 (with --hidden) the draft's last hidden
                                               state after reading the node (the standalone draft's, or
                                               the feature head's predicted feature); rows of nodes the
                                               draft never read (the deepest level) are zero
                                 hidden_valid  (M,) uint8   (with --hidden) 1 where `hidden` was recorded

The `parent_pred` column is left at 1.0 here; the trainer fills it with its
own first-stage predictions along each path.

    python tools/collect_traces.py --split fit --out ~/.cache/mcsd/traces/fit
    python tools/collect_traces.py --split heldout --out ~/.cache/mcsd/traces/heldout --limit 40
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from mcsd import TreeDecoder, load_model_pair
from mcsd.core.tree import DraftTree, TreeTopology
from mcsd.drafting.policies.acceptance import FEATURE_NAMES, candidate_features
from mcsd.drafting.policies.base import Frontier, TreePolicy
from mcsd.drafting.policies.learned import recent_acceptance
from mcsd.loading.cache import cache_dir
from mcsd.loading.data import chat_ids, load_prompts, stratified

GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag", "other")


class TracePolicy(TreePolicy):
    """Static growth of a wide topology that records features and labels of every node."""

    name = "trace"
    wants_target_logits = True

    def __init__(self, topology: TreeTopology, label_temperature: float = 1.0, hidden: bool = False):
        super().__init__(topology)
        self.label_temperature = label_temperature
        self.record_hidden = hidden
        self.drafter = None
        self.rows: list[dict] = []
        self.reset()

    def bind_drafter(self, drafter) -> None:
        self.drafter = drafter
        if self.record_hidden:
            drafter.keep_hidden = True

    def reset(self) -> None:
        self.recent = 0.5
        self.round = 0

    def begin_round(self) -> int:
        self._features = [torch.zeros(1, len(FEATURE_NAMES))]          # the root has no features
        self._last = None
        self._hidden: dict[int, torch.Tensor] = {}                     # node -> draft hidden state (H,)
        return self.topology.max_depth

    def expand(self, frontier: Frontier):
        k = int(frontier.max_children.max())
        if self.record_hidden:
            for node, h in zip(frontier.nodes.tolist(), self.drafter.last_hidden.float().cpu()):
                self._hidden[node] = h
        self._last = candidate_features(frontier, k, torch.ones(frontier.nodes.numel()), self.recent)
        return None

    def level_added(self, kept: torch.Tensor) -> None:
        self._features.append(self._last[:, :kept.shape[1]][kept].cpu())

    def observe_target(self, tree: DraftTree, logits: torch.Tensor) -> None:
        if tree.size < 2:
            return
        feats = torch.cat(self._features)[1:]                                            # (N-1, D)
        parents = tree.parents[1:]
        tokens = tree.tokens[1:]
        greedy = (logits[parents].argmax(-1) == tokens).cpu()
        p = torch.softmax(logits[parents].float() / self.label_temperature, -1).gather(1, tokens[:, None])[:, 0]
        q = (tree.logp[1:] - tree.logp[parents]).exp()
        row = {"features": feats.numpy(), "label_greedy": greedy.numpy().astype(np.uint8),
               "label_sampling": torch.clamp(p / q, max=1.0).cpu().numpy().astype(np.float32),
               "parent": (parents - 1).cpu().numpy(), "round": self.round}
        if self.record_hidden:
            width = self.drafter.last_hidden.shape[-1]
            hidden = torch.zeros(tree.size - 1, width)
            valid = torch.zeros(tree.size - 1, dtype=torch.uint8)
            for node, h in self._hidden.items():
                if node > 0:
                    hidden[node - 1], valid[node - 1] = h, 1
            row.update(hidden=hidden.half().numpy(), hidden_valid=valid.numpy())
        self.rows.append(row)

    def observe(self, n_accepted: int, tree: DraftTree, shared: int = 0) -> None:
        self.recent = recent_acceptance(self.recent, n_accepted, tree)       # as LearnedPolicy does
        self.round += 1

    def take(self) -> list[dict]:
        rows, self.rows = self.rows, []
        return rows


def flatten(rounds: list[dict], question_id: int, group: int) -> dict[str, np.ndarray]:
    """Concatenate one question's rounds into columns, turning parent indices into row numbers."""
    names = ["features", "label_greedy", "label_sampling", "parent_row", "question_id", "group", "round"]
    if rounds and "hidden" in rounds[0]:
        names += ["hidden", "hidden_valid"]
    cols: dict[str, list] = {k: [] for k in names}
    offset = 0
    for r in rounds:
        n = len(r["label_greedy"])
        if "hidden" in cols:
            cols["hidden"].append(r["hidden"])
            cols["hidden_valid"].append(r["hidden_valid"])
        cols["features"].append(r["features"])
        cols["label_greedy"].append(r["label_greedy"])
        cols["label_sampling"].append(r["label_sampling"])
        cols["parent_row"].append(np.where(r["parent"] >= 0, r["parent"] + offset, -1))
        cols["question_id"].append(np.full(n, question_id))
        cols["group"].append(np.full(n, group, dtype=np.int16))
        cols["round"].append(np.full(n, r["round"]))
        offset += n
    return {k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()}


def merge(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    out, offset = {}, 0
    shifted = []
    for p in parts:
        q = dict(p)
        q["parent_row"] = np.where(p["parent_row"] >= 0, p["parent_row"] + offset, -1)
        offset += len(p["label_greedy"])
        shifted.append(q)
    for k in shifted[0]:
        out[k] = np.concatenate([p[k] for p in shifted])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--drafter", default="model", choices=("model", "feature"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", default=None, help="Spec-Bench style JSONL (default: benchmarks/data/spec_bench/question.jsonl, or $MCSD_SPEC_BENCH)")
    ap.add_argument("--split", default="fit", choices=("fit", "heldout"))
    ap.add_argument("--limit", type=int, default=0, help="at most this many prompts (0 = all)")
    ap.add_argument("--per-group", type=int, default=0,
                    help="this many prompts of each category group (as the benchmark picks them; 0 = all)")
    ap.add_argument("--system", default=None,
                    help="system message for the chat template: traces of answers a drafter was not trained on "
                         "(a drafter distilled from the target's answers to these prompts has them by heart)")
    ap.add_argument("--tree", default="4,3,2,2,1,1", help="the wide tree traced")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--label-temperature", type=float, default=1.0)
    ap.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    ap.add_argument("--shard-size", type=int, default=8, help="questions per shard")
    ap.add_argument("--hidden", action="store_true",
                    help="also record the draft's last hidden state per node (SpecDec++ head training)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    if args.system is not None and args.no_chat:
        sys.exit("--system is a chat-template message; it has no effect with --no-chat")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or cache_dir() / "traces" / args.split
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {
        "features": list(FEATURE_NAMES), "groups": list(GROUPS), "done": [], "shards": [],
        "settings": {k: v for k, v in vars(args).items() if k != "out"}}
    if manifest["features"] != list(FEATURE_NAMES):
        sys.exit(f"{out} holds traces with other features; use a new --out")

    target, draft, tok = load_model_pair(args.target, args.draft, dtype=args.dtype, device=args.device,
                                         drafter=args.drafter)
    policy = TracePolicy(TreeTopology.from_spec(args.tree), args.label_temperature, hidden=args.hidden)
    dec = TreeDecoder(target, draft, tokenizer=tok, policy=policy, threads=None)
    prompts = load_prompts(args.prompts, split=args.split)
    if args.per_group:
        prompts = stratified(prompts, args.per_group)
    if args.limit:
        prompts = prompts[:args.limit]
    todo = [p for p in prompts if p.question_id not in set(manifest["done"])]
    pending: list[dict] = []
    pending_ids: list[int] = []

    def flush():
        if not pending:
            return
        name = f"shard-{len(manifest['shards']):05d}.npz"
        np.savez(out / (name + ".tmp.npz"), **merge(pending))
        (out / (name + ".tmp.npz")).replace(out / name)          # a shard appears whole or not at all
        manifest["shards"].append(name)
        manifest["done"].extend(pending_ids)
        tmp = manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        tmp.replace(manifest_path)
        pending.clear()
        pending_ids.clear()

    bar = tqdm(todo, desc=f"traces {args.split}", unit="prompt")
    nodes = 0
    for p in bar:
        ids = torch.tensor(tok(p.text, add_special_tokens=False)["input_ids"] if args.no_chat
                           else chat_ids(tok, p.text, system=args.system))
        dec.generate(ids, max_new_tokens=args.max_new_tokens)
        part = flatten(policy.take(), p.question_id, GROUPS.index(p.group) if p.group in GROUPS else len(GROUPS) - 1)
        if len(part["label_greedy"]):
            pending.append(part)
            nodes += len(part["label_greedy"])
        pending_ids.append(p.question_id)
        bar.set_postfix(nodes=nodes)
        if len(pending_ids) >= args.shard_size:
            flush()
    flush()
    print(f"{out}: {len(manifest['done'])} questions traced, shards {len(manifest['shards'])}")
    return 0
