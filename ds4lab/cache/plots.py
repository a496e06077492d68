"""Figures of a simulation's events (`ds4lab.cache.simulate`): reuse over time, directory
bytes against the budget, and the eviction timeline with each victim's score factors."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

_REASON_COLORS = {"cold": "tab:blue", "continued": "tab:orange", "evict": "tab:green", "shutdown": "tab:red"}


def _hours(events: pd.DataFrame) -> pd.Series:
    return events["time"] / 3600.0


def plot_hit_rate(events: pd.DataFrame, ax: Axes | None = None, window: int = 200) -> Axes:
    """Rolling share of requests served from memory and from disk, and the cumulative share
    of prompt tokens whose prefill was saved."""
    ax = ax or plt.gca()
    req = events[events["event"] == "request"]
    hours = _hours(req)
    for source, color in (("disk", "tab:blue"), ("memory", "tab:gray")):
        rate = (req["source"] == source).astype(float).rolling(window, min_periods=1).mean()
        ax.plot(hours, 100 * rate, color=color, label=f"{source} hits ({window}-request mean)")
    saved = 100 * req["matched_tokens"].cumsum() / req["tokens"].cumsum().clip(lower=1)
    ax.plot(hours, saved, color="black", linestyle="--", label="prefill tokens saved (cumulative)")
    ax.set_xlabel("simulated time (h)")
    ax.set_ylabel("share (%)")
    ax.set_ylim(0, 100)
    ax.legend(loc="lower right", fontsize="small")
    ax.set_title(f"reuse under {events.attrs.get('policy', '')}")
    return ax


def plot_directory(events: pd.DataFrame, ax: Axes | None = None) -> Axes:
    """Bytes of the cache directory after each event, against the budget."""
    ax = ax or plt.gca()
    ax.plot(_hours(events), events["dir_bytes"] / 2**30, color="tab:blue", linewidth=0.8, label="directory")
    budget = events.attrs.get("budget_bytes")
    if budget:
        ax.axhline(budget / 2**30, color="tab:red", linestyle="--", label="budget")
    ax.set_xlabel("simulated time (h)")
    ax.set_ylabel("cache directory (GiB)")
    ax.legend(loc="lower right", fontsize="small")
    return ax


def plot_evictions(events: pd.DataFrame, ax: Axes | None = None) -> Axes:
    """Each eviction: when, which kind of file (colour), its score (log scale) and its
    decayed hits (marker size); superseded continued checkpoints are outlined in black."""
    ax = ax or plt.gca()
    ev = events[events["event"] == "evict"]
    for reason, color in _REASON_COLORS.items():
        sel = ev[ev["reason"] == reason]
        if sel.empty:
            continue
        edge = np.where(sel["supersede_factor"] < 1.0, "black", "none")
        ax.scatter(_hours(sel), sel["score"], s=8 + 12 * sel["effective_hits"].fillna(0), color=color,
                   edgecolors=edge, linewidths=0.6, alpha=0.7, label=reason)
    if (ev["score"] > 0).any() and events.attrs.get("policy", "").startswith("ds4"):
        ax.set_yscale("log")
    ax.set_xlabel("simulated time (h)")
    ax.set_ylabel("score at eviction (tokens per file byte x factors)")
    ax.legend(title="evicted file", loc="upper right", fontsize="small")
    return ax


def plot_summary(events: pd.DataFrame, fig: Figure | None = None) -> Figure:
    """The three plots above, stacked on one time axis, in `fig` (an empty figure, say one
    made without pyplot; default a new 10 x 10 in pyplot figure)."""
    fig = plt.figure(figsize=(10, 10)) if fig is None else fig
    axes = fig.subplots(3, 1, sharex=True)
    plot_hit_rate(events, axes[0])
    plot_directory(events, axes[1])
    plot_evictions(events, axes[2])
    for ax in axes[:2]:
        ax.set_xlabel("")
    fig.tight_layout()
    return fig
