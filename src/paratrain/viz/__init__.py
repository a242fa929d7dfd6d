"""Plots and animations written to files (matplotlib, Agg backend)."""

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display), imported on use so
    that importing a drawing module stays cheap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, out_dir, name: str) -> Path:
    """Write ``fig`` as ``out_dir/name`` (the folder made if missing), close it, return
    the path."""
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    fig.savefig(path)
    plt.close(fig)
    return path

