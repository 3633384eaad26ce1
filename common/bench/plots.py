"""PNG plots for `tandem bench serve`: latency CDFs per run, and throughput / p99 latency vs request rate."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tandem.common.bench.metrics import RequestRecord

CDF_METRICS = {  # file stem -> (title, per-request values in seconds)
    "ttft_cdf": ("Time to first token", lambda records: [r.ttft for r in records]),
    "itl_cdf": ("Inter-token latency", lambda records: [gap for r in records for gap in r.itl]),
    "e2e_cdf": ("End-to-end latency", lambda records: [r.e2e for r in records]),
}


def _pyplot():
    try:  # matplotlib (~0.5 s): only --plot-dir draws
        import matplotlib
    except ImportError as e:
        raise ValueError("--plot-dir needs matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    return plt


def rate_label(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}"


def plot_cdfs(runs: list[tuple[float, list[RequestRecord]]], plot_dir: Path) -> list[Path]:
    """One PNG per metric, one curve per request rate."""
    plt = _pyplot()
    written = []
    for stem, (title, values_of) in CDF_METRICS.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for rate, records in runs:
            ms = np.sort(np.asarray(values_of([r for r in records if r.success]), dtype=np.float64) * 1e3)
            if ms.size:
                ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post", label=f"rate {rate_label(rate)}")
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        path = plot_dir / f"{stem}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def plot_sweep(rates: list[float], summaries: list[dict], plot_dir: Path) -> list[Path]:
    """Throughput and p99 latency against request rate; inf is drawn just right of the largest finite rate."""
    plt = _pyplot()
    finite = [r for r in rates if r != float("inf")]
    inf_x = (max(finite) * 1.5) if finite else 1.0
    xs = [inf_x if r == float("inf") else r for r in rates]
    labels = [rate_label(r) for r in rates]
    written = []

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [s["output_throughput"] for s in summaries], "o-", color="tab:blue", label="output tok/s")
    ax.set(title="Throughput vs request rate", xlabel="request rate (req/s)", ylabel="output tokens/s")
    req_ax = ax.twinx()
    req_ax.plot(xs, [s["request_throughput"] for s in summaries], "s--", color="tab:orange", label="requests/s")
    req_ax.set_ylabel("completed requests/s")
    req_ax.legend(loc="lower right")
    written.append(_finish(plt, fig, ax, xs, labels, plot_dir / "throughput_vs_rate.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        ax.plot(xs, [s[key]["p99"] if s[key]["p99"] is not None else np.nan for s in summaries], "o-",
                label=f"p99 {name}")
    ax.set(title="p99 latency vs request rate", xlabel="request rate (req/s)", ylabel="ms", yscale="log")
    written.append(_finish(plt, fig, ax, xs, labels, plot_dir / "p99_latency_vs_rate.png"))
    return written


def _finish(plt, fig, ax, xs: list[float], labels: list[str], path: Path) -> Path:
    ax.set_xticks(xs)
    ax.set_xticklabels(labels)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
