"""Drawing one round's draft tree for a person (networkx + matplotlib). Never on the decoding hot path.

Nodes are labelled with their token and the draft's probability of it under
its parent; the accepted path is highlighted and the target's own extra token
is drawn below it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ConfigError


def tree_graph(tree, acceptance, tokenizer=None):
    """A networkx DiGraph of the tree: node attributes `label`, `depth`, `accepted`, `prob`."""
    import networkx as nx

    def text(tok: int) -> str:
        if tokenizer is None:
            return str(tok)
        return repr(tokenizer.decode([tok]))[1:-1][:12] or "?"

    g = nx.DiGraph()
    tokens, parents, depth = tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist()
    logp = tree.logp.tolist()
    on_path = set(acceptance.path.tolist())
    for i, tok in enumerate(tokens):
        prob = 1.0 if parents[i] < 0 else float(torch.tensor(logp[i] - logp[parents[i]]).exp())
        g.add_node(i, label=f"{text(tok)}\n{prob:.2f}" if i else f"{text(tok)}\n(root)", depth=depth[i],
                   accepted=i in on_path, prob=prob)
        if parents[i] >= 0:
            g.add_edge(parents[i], i)
    last = int(acceptance.path[-1])
    g.add_node("next", label=f"{text(int(acceptance.next_token))}\n(target)", depth=depth[last] + 1,
               accepted=True, prob=1.0)
    g.add_edge(last, "next")
    return g


def _layered_positions(g) -> dict:
    # Leaves get consecutive x slots; a parent sits above the middle of its children.
    pos, slot = {}, [0]

    def place(n):
        kids = list(g.successors(n))
        for k in kids:
            place(k)
        x = sum(pos[k][0] for k in kids) / len(kids) if kids else slot[0]
        if not kids:
            slot[0] += 1
        pos[n] = (x, -g.nodes[n]["depth"])

    place(0)
    return pos


def draw_tree(tree, acceptance, path: str | Path, tokenizer=None, title: str | None = None) -> Path:
    """Write a PNG of one round's tree with the accepted path highlighted."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("drawing a tree needs matplotlib: pip install matplotlib") from None
    import networkx as nx

    g = tree_graph(tree, acceptance, tokenizer)
    pos = _layered_positions(g)
    width = max(6.0, 1.1 * (1 + max(x for x, _ in pos.values())))
    height = max(3.0, 1.4 * (1 + max(-y for _, y in pos.values())))
    fig, ax = plt.subplots(figsize=(min(width, 40), height))
    colors = ["#f4a259" if n == "next" else "#8cc084" if g.nodes[n]["accepted"] else "#dddddd" for n in g.nodes]
    edge_colors = ["#2a7f3f" if g.nodes[u]["accepted"] and g.nodes[v]["accepted"] else "#aaaaaa" for u, v in g.edges]
    nx.draw_networkx_edges(g, pos, ax=ax, edge_color=edge_colors, arrows=False, width=1.5)
    nx.draw_networkx_nodes(g, pos, ax=ax, node_color=colors, node_size=1500, edgecolors="#555555")
    nx.draw_networkx_labels(g, pos, ax=ax, labels={n: g.nodes[n]["label"] for n in g.nodes}, font_size=7)
    ax.set_title(title or f"draft tree: {tree.size - 1} nodes, {acceptance.n_accepted} accepted")
    ax.axis("off")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
