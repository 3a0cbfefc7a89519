"""PNG plots of one bench run (matplotlib, the ``bench`` extra): speedup per category per method, tau
distribution, acceptance by draft position, decode tokens/s against the memory-bandwidth roofline."""

from __future__ import annotations

from pathlib import Path

from dflash2.bench.runner import label


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise RuntimeError("the report's plots need matplotlib: pip install -e .[bench]") from error
    return plt


def write_plots(run, out_dir: Path) -> list[tuple[str, Path]]:
    """Every plot the run has data for, as (title, path)."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    for title, name, draw in (("Speedup per category (vs dflash2 plain)", "speedup.png", _speedup),
                              ("tau per request", "tau.png", _tau),
                              ("Acceptance by draft position (all prompts)", "acceptance.png", _acceptance),
                              ("Decode tokens/s vs the bandwidth roofline", "roofline.png", _roofline)):
        figure, axes = plt.subplots(figsize=(10, 4.8))
        if draw(run, axes):
            axes.set_title(title)
            figure.tight_layout()
            figure.savefig(out_dir / name, dpi=110)
            plots.append((title, out_dir / name))
        plt.close(figure)
    return plots


def _methods(run) -> list[str]:
    return list(dict.fromkeys(s["method"] for s in run.summary))


def _colors(count: int) -> list:
    """``count`` distinct colours (tab20 past ten methods: no two bars of a group share one)."""
    plt = _pyplot()
    cmap = plt.get_cmap("tab10" if count <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(count)]


def _speedup(run, axes) -> bool:
    categories = list(dict.fromkeys(s["category"] for s in run.summary))
    methods = _methods(run)
    by_key = {(s["category"], s["method"]): s["speedup"] for s in run.summary}
    width = 0.8 / len(methods)
    for i, (method, color) in enumerate(zip(methods, _colors(len(methods)))):
        values = [by_key.get((c, method)) or 0.0 for c in categories]
        axes.bar([x + i * width for x in range(len(categories))], values, width, label=label(method), color=color)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks([x + 0.4 - width / 2 for x in range(len(categories))], categories, rotation=20, ha="right")
    axes.set_ylabel("decode tok/s / dflash2 plain")
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return True


def _tau(run, axes) -> bool:
    methods = [m for m in _methods(run) if any(r["method"] == m and r["tau"] is not None for r in run.rows)]
    data = [[r["tau"] for r in run.rows if r["method"] == m and r["tau"] is not None] for m in methods]
    if not methods:
        return False
    axes.boxplot(data, showmeans=True)
    for i, values in enumerate(data, start=1):
        axes.scatter([i] * len(values), values, s=10, alpha=0.6)
    axes.set_xticks(range(1, len(methods) + 1), [label(m) for m in methods], rotation=20, ha="right", fontsize=7)
    axes.set_ylabel("new tokens per target pass")
    return True


def _acceptance(run, axes) -> bool:
    drawn, longest = False, 0
    overall = [s for s in run.summary if s["category"] == "overall"]
    for s, color in zip(overall, _colors(len(overall))):
        if s["acceptance_by_position"]:
            values = s["acceptance_by_position"]
            axes.plot(range(1, len(values) + 1), values, marker="o", label=label(s["method"]), color=color)
            drawn, longest = True, max(longest, len(values))
    if drawn:
        axes.set_xticks(range(1, longest + 1))
        axes.set_xlabel("draft position")
        axes.set_ylabel("accepted / drafted")
        axes.set_ylim(0, 1.05)
        axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return drawn


def _roofline(run, axes) -> bool:
    info = run.info
    overall = [s for s in run.summary if s["category"] == "overall"]
    bandwidth = info.get("read_bandwidth_GBps")
    if not bandwidth or not overall:
        return False
    gguf = {"llamacpp", "llamacpp-spec"}
    colors = ["tab:orange" if s["method"] in gguf else "tab:blue" for s in overall]
    axes.bar(range(len(overall)), [s["tokens_per_s"] for s in overall], color=colors)
    axes.set_xticks(range(len(overall)), [label(s["method"]) for s in overall], rotation=20, ha="right", fontsize=7)
    ceilings = ((info.get("weight_bytes_per_token"), f"{str(info.get('dtype', '')).replace('torch.', '')} roofline",
                  "tab:blue"),
                (info.get("gguf_bytes_per_token"), "GGUF 4-bit roofline", "tab:orange"))
    for bytes_per_token, name, color in ceilings:
        if bytes_per_token:
            ceiling = bandwidth * 1e9 / bytes_per_token
            axes.axhline(ceiling, color=color, linestyle="--", label=f"{name}: {ceiling:.1f} tok/s")
    axes.set_ylabel(f"decode tok/s (bandwidth {bandwidth:.1f} GB/s)")
    axes.legend(fontsize=7)
    return True
