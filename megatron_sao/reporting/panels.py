"""The figures of a run report: which metrics go together, and drawing one panel to a PNG.

A panel names its metrics exactly (`keys`, in legend order) or by a regex (`pattern`: every
logged key that matches, e.g. whatever success metric the driver or the evaluation logs). A panel
with nothing logged is not drawn; the page says "not logged" for it, and a drawn panel lists the
keys of its own that are missing, so a renamed metric is visible rather than silently absent.
Keys are those of docs/training.md (trainer), `pipeline/buffer.py` (staleness, buffer) and the
rollout service (`rollout/*` accounting).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatron_sao.reporting.metrics import natural_order, series


@dataclass(frozen=True, slots=True)
class Panel:
    name: str
    """File stem of the PNG (`<name>.png`)."""
    title: str
    keys: tuple[str, ...] = ()
    """Exact metric keys, drawn in this order."""
    pattern: str | None = None
    """Regex: every logged key matching it (natural order), after `keys`."""
    ylabel: str = ""
    kind: Literal["line", "stack"] = "line"
    """`stack`: stacked areas (fractions that add up to 1, e.g. the staleness histogram)."""
    caption: str = ""
    """What the curve shows and what to look for."""
    x_key: str | None = None
    """Draw against this metric of each row instead of its step (evaluation during training is
    logged when it finishes, drawn at `eval/step`, the step whose policy it evaluated)."""

    def present_keys(self, logged: set[str]) -> list[str]:
        out = [k for k in self.keys if k in logged]
        if self.pattern is not None:
            regex = re.compile(self.pattern)
            out += sorted((k for k in logged if regex.search(k) and k not in out), key=natural_order)
        return out

    def missing_keys(self, logged: set[str]) -> list[str]:
        return [k for k in self.keys if k not in logged]

    def describe_keys(self) -> str:
        names = [*self.keys, *([f"/{self.pattern}/"] if self.pattern else [])]
        return ", ".join(names)


PANELS: tuple[Panel, ...] = (
    Panel("reward", "Reward", ("train/reward_mean",), ylabel="mean reward",
          caption="Mean total reward of each step's batch."),
    Panel("success", "Success rate", pattern=r"^(?!eval/success(/|$)).*success", ylabel="fraction",
          caption="Trajectories (or held-out prompts) solved: terminal reward 1.0."),
    Panel("heldout_eval", "Held-out evaluation during training", ("eval/success", "eval/reward"),
          pattern=r"^eval/success/", ylabel="held-out", x_key="eval/step",
          caption="Held-out prompts rolled out on the run's engines between batches (eval.every_n_steps, "
                  "eval.num_prompts): share solved, mean reward, and success per difficulty tier when the "
                  "prompts carry one; drawn at the step whose policy was evaluated."),
    Panel("response_length", "Response length", ("train/response_length_mean",), ylabel="tokens",
          caption="Mean tokens after the prompt (actions and observations)."),
    Panel("critic_ev", "Critic explained variance", ("critic/explained_variance",), ylabel="EV",
          caption="1 - Var(returns - values) / Var(returns) of the values the advantages came from; "
                  "climbs towards 1 as the critic learns."),
    Panel("dis_masked", "DIS masked fractions", ("actor/dis_masked_low_frac", "actor/dis_masked_high_frac"),
          ylabel="fraction of action tokens",
          caption="Tokens masked by the DIS band: importance ratio below 1 - eps_low (low) or above "
                  "1 + eps_high (high)."),
    Panel("staleness", "Staleness", ("staleness/mean", "staleness/max"), ylabel="actor versions",
          caption="actor version - the version that sampled each action token of the batch."),
    Panel("staleness_histogram", "Staleness histogram", pattern=r"^staleness/token_frac_(\d+|over)$",
          ylabel="fraction of action tokens", kind="stack",
          caption="Share of the batch's action tokens at each staleness; `over` is beyond "
                  "algorithm.max_staleness (kept by stale_policy=keep)."),
    Panel("throughput", "Throughput", ("perf/tokens_per_s",), pattern=r"^perf/.*_per_s$", ylabel="per second",
          caption="Trainer tokens per second (and any other rate the run logs)."),
    Panel("rollout", "Rollout accounting",
          ("rollout/started", "rollout/completed", "rollout/aborted", "rollout/failed", "rollout/in_flight"),
          ylabel="trajectories (cumulative)",
          caption="started == completed + aborted + failed + in_flight at every step."),
    Panel("buffer", "Ready buffer and trainer wait", ("buffer/wait_s_mean", "buffer/wait_s_max",
                                                      "time/wait_for_batch_s"), ylabel="seconds",
          caption="Time trajectories waited in the buffer (put -> taken) and the trainer waited for a batch."),
    Panel("losses", "Losses", ("actor/loss", "critic/value_loss"), ylabel="loss",
          caption="Actor policy loss and critic value loss (first update of each step)."),
)


def panel_points(panel: Panel, rows: dict[int, dict], key: str) -> tuple[list[float], list[float]]:
    """(x, y) of `key` in `panel`: x is the row's step, or its `panel.x_key` value (rows without
    one are left out)."""
    steps, values = series(rows, key)
    if panel.x_key is None:
        return [float(s) for s in steps], values
    x_of = dict(zip(*series(rows, panel.x_key), strict=True))
    points = [(x_of[s], v) for s, v in zip(steps, values, strict=True) if s in x_of]
    return [x for x, _ in points], [v for _, v in points]


def draw_panel(panel: Panel, rows: dict[int, dict], keys: list[str], out: Path) -> Path:
    """Draw `keys` (all logged) of `panel` against `step` into `out` (PNG, headless Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    if panel.kind == "stack":
        steps = sorted({s for k in keys for s in series(rows, k)[0]})
        columns = []
        for key in keys:
            lookup = dict(zip(*series(rows, key), strict=True))
            columns.append([lookup.get(s, 0.0) for s in steps])
        labels = [_short(k) for k in keys]
        if len(steps) == 1:  # one step has no area: draw it as a stacked bar
            bottom = 0.0
            for label, column in zip(labels, columns, strict=True):
                ax.bar(steps, column, bottom=bottom, label=label, width=0.6)
                bottom += column[0]
        else:
            ax.stackplot(steps, columns, labels=labels, alpha=0.85)
    else:
        for key in keys:
            steps, values = panel_points(panel, rows, key)
            ax.plot(steps, values, label=key, linewidth=1.4, marker="." if len(steps) < 60 else None)
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    if len(keys) > 1:
        ax.legend(fontsize=7, loc="best", ncol=2 if len(keys) > 4 else 1)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _short(key: str) -> str:
    """Legend label of a stacked key: `staleness/token_frac_2` -> `staleness 2`."""
    return "staleness " + key.rsplit("/", 1)[-1].removeprefix("token_frac_")
