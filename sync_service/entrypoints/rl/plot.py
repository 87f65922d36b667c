"""The reward curves of an ``RLResult`` as a PNG (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["save_reward_plot"]


def save_reward_plot(result, path: str | Path) -> Path:
    """Write mean reward per step, with sync and without (control), to ``path``; returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    steps = range(len(result.synced.rewards))
    ax.plot(steps, result.synced.rewards, marker="o", ms=3, label="weights synced (push_async every step)")
    ax.plot(steps, result.control.rewards, marker="s", ms=3, label="control: sync disabled after version 0")
    ax.set_xlabel("training step")
    ax.set_ylabel("mean reward of the step's rollouts")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("toy GRPO on a Qwen3-MoE + LoRA (attention + experts)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
