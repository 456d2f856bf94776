"""The curve step's result as one PNG: measured beside the rtx4090-70b projection.

Left: ms per target pass against tree size, every layer streamed. Right: ms per pass
against layers resident in VRAM, for 1-token passes and the largest tree. Solid lines
are measured here; dashed, the profile's prior as written (a 4090 on PCIe 4.0);
dotted, the same prior at this machine's measured copy peak, the fair comparison.
"""

from __future__ import annotations

from pathlib import Path

COLORS = {"int4": "tab:blue", "bf16": "tab:orange"}
STYLES = {0: "--", 1: ":"}  # the projection variants, in curve.projection's order


def curve_png(curve: dict, path: Path) -> Path | None:
    """Write the plot; None when nothing was measured."""
    stacks = {q: curve[q] for q in COLORS if q in curve and curve[q].get("pass_ms", {}).get("0")}
    if not stacks:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_size, by_resident) = plt.subplots(1, 2, figsize=(12, 4.8))
    for quant, res in stacks.items():
        color = COLORS[quant]
        streamed = res["pass_ms"]["0"]
        sizes = sorted(int(s) for s in streamed)
        eff = f", copy {res['copy_efficiency']:.0%} of peak" if "copy_efficiency" in res else ""
        by_size.plot(sizes, [streamed[str(s)] for s in sizes], marker="o", color=color,
                     label=f"{quant}: measured{eff}")
        for k, (name, proj) in enumerate(res.get("projection", {}).items()):
            if "pass_ms" not in proj:
                continue
            xs = sorted(int(s) for s in proj["pass_ms"])
            by_size.plot(xs, [proj["pass_ms"][str(s)] for s in xs], linestyle=STYLES.get(k, "-."), color=color,
                         alpha=0.8, label=f"{quant}: {name}")
        _resident_panel(by_resident, quant, res, color)
    by_size.set_xscale("log", base=2)
    by_size.set_yscale("log")
    by_size.set_xlabel("tree size (tokens verified in one pass)")
    by_size.set_ylabel("ms per target pass")
    by_size.set_title("every layer streamed from pinned RAM")
    by_size.legend(fontsize=7)
    by_resident.set_xlabel("layers resident in VRAM (the rest stream)")
    by_resident.set_ylabel("ms per target pass")
    by_resident.set_yscale("log")
    by_resident.set_title("pass time by resident layers")
    by_resident.legend(fontsize=7)
    layers = next(iter(stacks.values()))["layers"]
    fig.suptitle(f"{layers}-layer {next(iter(stacks.values()))['shape']} stack on {curve.get('device', '?')}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _resident_panel(ax, quant: str, res: dict, color: str) -> None:
    by_r = {int(r): pts for r, pts in res["pass_ms"].items()}
    sizes = sorted({int(s) for r, pts in by_r.items() if r for s in pts})
    for size, marker in zip((min(sizes, default=1), max(sizes, default=1)), ("o", "s")):
        rs = sorted(r for r, pts in by_r.items() if str(size) in pts)
        if rs:
            ax.plot(rs, [by_r[r][str(size)] for r in rs], marker=marker, color=color,
                    label=f"{quant}, tree {size}: measured")
        for k, (name, proj) in enumerate(res.get("projection", {}).items()):
            if "by_resident" not in proj:
                continue
            pts = {int(r): v for r, v in proj["by_resident"].items() if str(size) in v["ms"]}
            if pts:
                rs = sorted(pts)
                ax.plot(rs, [pts[r]["ms"][str(size)] for r in rs], linestyle=STYLES.get(k, "-."), marker=marker,
                        markersize=3, color=color, alpha=0.6,
                        label=f"{quant}, tree {size}: {name} (places up to {max(p['placed'] for p in pts.values())})")
