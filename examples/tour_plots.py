"""Figures of the default-model tour (``examples/default_model_tour.py``): indexer selections as heat maps over the
prompt's tokens, expert load per layer as bars, and two sampling settings side by side.

Needs matplotlib (``pip install -e ".[examples]"``). Each function takes plain numpy data and returns a Figure.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # files only; works without a display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402


def selection_matrix(topk: np.ndarray, ratio: int, seq_len: int) -> np.ndarray:
    """``[S, S]`` 0/1 matrix: query t (row) selected the compressed row covering token s (column).

    ``topk`` ``[S, k]`` holds compressed-row ids per query (−1 = unused); row j of a ratio-r layer covers tokens
    ``r·j … r·j + r − 1``.
    """
    sel = np.zeros((seq_len, seq_len), np.float32)
    for t in range(seq_len):
        for j in topk[t]:
            if j >= 0:
                sel[t, ratio * j: min(ratio * j + ratio, seq_len)] = 1.0
    return sel


def plot_indexer_selections(topk_by_layer: Mapping[int, np.ndarray], ratios: Sequence[int],
                            pieces: Sequence[str]) -> Figure:
    """One heat map per index-source layer: which prompt tokens each query's selected compressed rows cover."""
    layers = sorted(topk_by_layer)
    n = len(pieces)
    cols = min(3, len(layers))
    rows = -(-len(layers) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 4.4 * rows), squeeze=False, constrained_layout=True)
    labels = [p.replace("\n", "⏎") if p.strip() else repr(p) for p in pieces]
    for ax, layer in zip(axes.flat, layers, strict=False):
        sel = selection_matrix(topk_by_layer[layer], ratios[layer], n)
        ax.imshow(sel, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(f"layer {layer} (ratio {ratios[layer]})")
        step = max(1, n // 12)
        ax.set_xticks(range(0, n, step), [labels[i] for i in range(0, n, step)], rotation=70, fontsize=7)
        ax.set_yticks(range(0, n, step), [labels[i] for i in range(0, n, step)], fontsize=7)
        ax.set_xlabel("key token (covered by a selected compressed row)")
        ax.set_ylabel("query token")
    for ax in list(axes.flat)[len(layers):]:
        ax.axis("off")
    fig.suptitle("Indexer top-k selections over the prompt (blue = selected)")
    return fig


def plot_expert_load(router_indices: Mapping[int, np.ndarray], n_experts: int) -> Figure:
    """Bars per layer: how many of the prompt's (token, slot) routing choices went to each expert."""
    layers = sorted(router_indices)
    cols = min(4, len(layers))
    rows = -(-len(layers) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows), squeeze=False, sharey=True,
                             constrained_layout=True)
    for ax, layer in zip(axes.flat, layers, strict=False):
        counts = np.bincount(np.asarray(router_indices[layer]).reshape(-1), minlength=n_experts)
        ax.bar(np.arange(n_experts), counts, color="tab:orange")
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_xticks(range(n_experts))
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(layers):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("tokens routed")
    for ax in axes[-1, :]:
        ax.set_xlabel("expert")
    fig.suptitle("Expert load per layer over the prompt")
    return fig


def plot_sampling_settings(prompt: str, runs: Mapping[str, Sequence[tuple[str, Sequence[float]]]]) -> Figure:
    """Two (or more) sampling settings side by side: per setting, the continuations as text (top) and the
    log-probability of every sampled token (bottom, one line per request)."""
    names = list(runs)
    fig, axes = plt.subplots(2, len(names), figsize=(6.2 * len(names), 7.0), squeeze=False,
                             gridspec_kw={"height_ratios": [1.3, 1.0]}, constrained_layout=True)
    for col, name in enumerate(names):
        text_ax, lp_ax = axes[0, col], axes[1, col]
        text_ax.axis("off")
        text_ax.set_title(name)
        y = 1.0
        for k, (cont, _) in enumerate(runs[name]):
            wrapped = textwrap.fill(f"[{k + 1}] {prompt}{cont}", 62)
            text_ax.text(0.0, y, wrapped, va="top", ha="left", fontsize=8, family="monospace",
                         transform=text_ax.transAxes)
            y -= 0.12 * (wrapped.count("\n") + 1) + 0.05
        for k, (_, lps) in enumerate(runs[name]):
            lp_ax.plot(range(len(lps)), lps, marker=".", label=f"[{k + 1}]")
        lp_ax.set_xlabel("generated token")
        lp_ax.set_ylabel("log-probability of the sampled token")
        lp_ax.legend(fontsize=8)
    ymin = min(min(lps, default=0.0) for r in runs.values() for _, lps in r)
    for ax in axes[1]:
        ax.set_ylim(min(ymin, -0.1) * 1.05, 0.05)
    fig.suptitle("Greedy vs sampled continuations")
    return fig
