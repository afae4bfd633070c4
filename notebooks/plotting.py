"""What every chapter's plot script shares: one way to save a figure."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save(fig, path):
    """Lays `fig` out, writes it to `path` (PNG, 120 dpi), closes it, and returns the path."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
