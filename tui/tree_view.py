"""Rendering of the last verified token tree.

Each node shows its token, one coloured dot per minion that proposed it and the
voted score. The path the target accepted is green with a check mark, and the
target's own bonus token hangs below it as a star.
"""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from rich.tree import Tree

from minions_local.core.events import TreeSnapshot

PALETTE = ["#4fc1ff", "#ff79c6", "#f1fa8c", "#ffb86c", "#bd93f9", "#8be9fd", "#ff5555"]
ACCEPTED = "bold #50fa7b"
BONUS = "bold #ff79c6"
VISIBLE = str.maketrans({" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"})
MAX_NODES = 400
"""Larger trees are cut (by score) so the panel stays responsive."""


def minion_colors(names: list[str]) -> dict[str, str]:
    """A stable colour per minion, in the engine's order."""
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(names)}


def show_token(text: str) -> str:
    """A token with its whitespace made visible."""
    return text.translate(VISIBLE) if text else "∅"


def legend(colors: dict[str, str]) -> Text:
    out = Text()
    for name, color in colors.items():
        out.append("● ", style=color).append(name + "  ")
    out.append("✓ ", style=ACCEPTED).append("accepted  ")
    out.append("★ ", style=BONUS).append("target's bonus")
    return out


def _children(tree: TreeSnapshot) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {i: [] for i in range(len(tree.tokens))}
    keep = set(sorted(range(len(tree.tokens)), key=lambda i: -tree.scores[i])[:MAX_NODES])
    keep.update(tree.accepted_path)
    keep.add(0)
    for i, parent in enumerate(tree.parents):
        if parent >= 0 and i in keep and parent in keep:
            kids[parent].append(i)
    for parent in kids:
        kids[parent].sort(key=lambda i: (i not in tree.accepted_path, -tree.scores[i], i))
    return kids


def _label(tree: TreeSnapshot, node: int, colors: dict[str, str], on_path: bool) -> Text:
    label = Text()
    if on_path:
        label.append("✓ ", style=ACCEPTED)
    token_style = ACCEPTED if on_path else ""
    label.append(f" {show_token(tree.texts[node])} ", style=token_style + " on #303446")
    label.append(" ")
    for name in colors:
        if name in tree.proposers[node]:
            label.append("●", style=colors[name])
    for name in tree.proposers[node]:
        if name not in colors:
            label.append("●", style="white")
    label.append(f" {tree.scores[node]:.0%}", style="dim")
    if not on_path:
        label.stylize("dim", 0, len(label))
    return label


def render_tree(
    tree: TreeSnapshot | None, colors: dict[str, str], *, pass_number: int = 0
) -> Group | Text:
    """The whole panel: a summary line, the legend, then the tree itself."""
    if tree is None or not tree.tokens:
        return Text(
            "No tree yet. Send a message: the tree the target verified last appears here.",
            style="dim italic",
        )
    accepted = [n for n in tree.accepted_path if n != 0]
    path_text = "".join(tree.texts[n] for n in accepted)
    summary = Text.assemble(
        (f"Pass {pass_number}" if pass_number else "Last pass", "bold"),
        f" · {len(tree.tokens) - 1} draft nodes · {len(accepted)} accepted",
        " + 1 bonus" if tree.bonus_text else "",
    )
    accepted_line = Text("accepted: ", style="dim").append(
        show_token(path_text), style=ACCEPTED
    )
    if tree.bonus_text:
        accepted_line.append(show_token(tree.bonus_text), style=BONUS)

    kids = _children(tree)
    on_path = set(tree.accepted_path)
    last_accepted = tree.accepted_path[-1] if tree.accepted_path else 0
    root = Tree(
        Text("◆ ", style="bold").append(show_token(tree.texts[0]), style="bold")
        .append("  (last committed token)", style="dim"),
        guide_style="#50fa7b",
    )
    stack: list[tuple[int, Tree]] = [(0, root)]
    while stack:
        node, branch = stack.pop()
        added = []
        for child in kids[node]:
            path = child in on_path
            sub = branch.add(
                _label(tree, child, colors, path), guide_style="#50fa7b" if path else "#585b70"
            )
            added.append((child, sub))
        if node == last_accepted and tree.bonus_text:
            branch.add(
                Text("★ ", style=BONUS).append(f" {show_token(tree.bonus_text)} ", style=BONUS + " on #303446")
                .append(" target", style="dim"),
                guide_style="#ff79c6",
            )
        stack.extend(reversed(added))
    return Group(summary, legend(colors), accepted_line, Text(""), root)
