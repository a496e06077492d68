"""An ipywidgets panel that re-runs a simulation as the budget, hit half-life, boundary trim
and alignment change, and redraws the summary figure and the headline numbers.

The figure is drawn without pyplot. A widget callback runs in a comm handler, and ipykernel
handles the frontend's Output-widget syncs on a subshell thread that fires IPython's
post_execute, where matplotlib-inline's flush_figures displays and closes every open pyplot
figure: a pyplot figure drawn in the callback can be rendered by both threads at once and comes
out blank (and a stray copy lands in JupyterLab's log console)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import ipywidgets as widgets
from IPython.display import display
from matplotlib.figure import Figure

from .plots import plot_summary
from .policies import DEFAULT_POLICY, HALF_LIFE_S, POLICIES, get_policy
from .simulate import simulate, summary


def cache_panel(records: Iterable[dict[str, Any]], policy: str = DEFAULT_POLICY, budget_mb: int = 4096,
                options: dict[str, Any] | None = None) -> widgets.VBox:
    """Sliders for budget (MiB), half-life (h), trim and align (tokens) over a fixed trace."""
    records = list(records)
    pick = widgets.Dropdown(options=list(POLICIES), value=policy, description="policy")
    budget = widgets.IntSlider(value=budget_mb, min=256, max=65536, step=256, description="budget MiB",
                               continuous_update=False)
    half = widgets.FloatSlider(value=HALF_LIFE_S / 3600, min=0.5, max=48, step=0.5, description="half-life h",
                               continuous_update=False)
    trim = widgets.IntSlider(value=32, min=0, max=512, step=16, description="trim", continuous_update=False)
    align = widgets.IntSlider(value=2048, min=0, max=8192, step=512, description="align", continuous_update=False)
    out = widgets.Output()

    def rerun(_: Any = None) -> None:
        pol = get_policy(pick.value).with_(half_life_s=half.value * 3600)
        opts = {**(options or {}), "boundary_trim_tokens": trim.value, "boundary_align_tokens": align.value}
        events = simulate(records, pol, budget.value << 20, opts)
        with out:
            out.clear_output(wait=True)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in summary(events).items()})
            display(plot_summary(events, Figure(figsize=(10, 10))))

    for w in (pick, budget, half, trim, align):
        w.observe(rerun, names="value")
    rerun()
    return widgets.VBox([widgets.HBox([pick, budget, half]), widgets.HBox([trim, align]), out])
