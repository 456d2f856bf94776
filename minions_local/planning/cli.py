"""The command line over profiles: list them, print the schema, or plan one.

    python -m minions_local.planning --list
    python -m minions_local.planning --plan rtx4090-70b [--target PATH] [--minion PATH ...]
    python -m minions_local.planning --schema      # every field, with its description

    from minions_local.planning.cli import plan_report
    print(plan_report("rtx4090-70b"))              # what --plan prints

The profiles themselves are `minions_local.profile` (schema, loading, dimensions); the
plan is `minions_local.planning.memory_plan`, the cost model's prior `.cost_prior`.
"""

from __future__ import annotations

import argparse
import sys

from minions_local.core.errors import MinionsError
from minions_local.core.tiers import TIERS
from minions_local.planning.report import plan_report
from minions_local.profile import available_profiles, load_profile

__all__ = ["available_profiles", "plan_report", "schema_reference", "main"]


def schema_reference() -> str:
    """Every profile field with its type, default and description (markdown)."""
    from minions_local.profile import schema

    sections = [
        ("[hardware]", schema.Hardware),
        ("[target]", schema.TargetSection),
        ("[target.dims], [minions.dims]", schema.KnownDims),
        ("[[minions]]", schema.MinionSection),
        ("[speculation]", schema.Speculation),
    ]
    out = ["# Profile fields", ""]
    for title, model in sections:
        out += [f"## {title}", "", (model.__doc__ or "").strip(), ""]
        out += ["| field | type | default | meaning |", "|---|---|---|---|"]
        for name, f in model.model_fields.items():
            kind = _type_name(f.annotation)
            if kind is None:
                continue  # a nested table, documented in its own section
            default = "required" if f.is_required() else repr(f.get_default(call_default_factory=True))
            out.append(f"| `{name}` | {kind} | {default} | {f.description or ''} |")
        out.append("")
    return "\n".join(out)


def _type_name(annotation) -> str | None:
    """A short, table-safe name: 'cpu' / 'cuda' for literals; None for nested tables."""
    import types
    import typing

    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return None
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " / ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        names = [_type_name(a) for a in inner]
        if any(n is None for n in names):
            return None
        return " or ".join(names) + (", optional" if len(inner) < len(args) else "")
    if origin is dict:
        return "table"
    if origin is list:
        return "list"
    return getattr(annotation, "__name__", str(annotation))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minions_local.planning", description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="list available profiles")
    parser.add_argument("--plan", metavar="PROFILE", help="print the memory plan and predicted tokens/s")
    parser.add_argument("--target", help="use this target model instead of the profile's")
    parser.add_argument("--minion", action="append", help="use this minion (repeat; 'ngram' for n-gram)")
    parser.add_argument("--tier", choices=TIERS, help="override target.tier")
    parser.add_argument("--schema", action="store_true", help="print every profile field (markdown)")
    args = parser.parse_args(argv)
    try:
        if args.schema:
            print(schema_reference())
        elif args.plan:
            print(plan_report(args.plan, target=args.target, minions=args.minion, tier=args.tier))
        else:
            for name in available_profiles():
                desc = ""
                try:
                    desc = load_profile(name).description
                except MinionsError as err:
                    desc = f"(invalid: {str(err).splitlines()[0]})"
                print(f"{name:<24} {desc}")
    except MinionsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
