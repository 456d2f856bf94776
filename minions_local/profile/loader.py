"""Finding, reading and validating profiles; resolving the model paths in them.

A profile is named (a shipped one, e.g. 'rtx4090-70b', or 'generated/NAME' for what
autotune wrote) or given as a path to a .toml file. Errors say which file, which
field, and what the closest valid choice is, because a profile is typed by hand.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from importlib.resources import files
from pathlib import Path
from typing import Any, Iterable

from pydantic import BaseModel, ValidationError

from minions_local.core.errors import ProfileError
from minions_local.profile.schema import OF_THE_TARGET, Profile

MODELS_DIR_ENV = "MINIONS_MODELS_DIR"
DEFAULT_MODELS_DIR = "~/models"


def shipped_dir() -> Path:
    """The folder of shipped profiles (`profiles/` in a checkout).

    Installed, it is the package `minions_local.profiles_data`. Run from a source tree
    on PYTHONPATH without installing (the GPU check does: the machine it runs on has no
    pip access), that package does not exist and the checkout's folder is the one."""
    try:
        return Path(str(files("minions_local.profiles_data")))
    except ModuleNotFoundError:
        checkout = Path(__file__).resolve().parents[2] / "profiles"
        if checkout.is_dir():
            return checkout
        raise


def generated_dir() -> Path:
    """Where autotune writes profiles by default; never holds hand-written ones."""
    return shipped_dir() / "generated"


def demo_models_dir() -> Path:
    return Path(str(files("minions_local"))) / "demo_models"


def models_dir() -> Path:
    """The user's models folder: $MINIONS_MODELS_DIR, else ~/models."""
    return Path(os.environ.get(MODELS_DIR_ENV) or DEFAULT_MODELS_DIR).expanduser()


def available_profiles() -> list[str]:
    """Names load_profile() accepts: shipped profiles, then 'generated/NAME' ones."""
    names = sorted(p.stem for p in shipped_dir().glob("*.toml"))
    if generated_dir().is_dir():
        names += sorted(f"generated/{p.stem}" for p in generated_dir().glob("*.toml"))
    return names


def resolve_model_path(spec: str, relative_to: Path | None = None) -> str:
    """An absolute path for a model reference in a profile (see Target.path)."""
    if spec.startswith("builtin:"):
        from minions_local.models.builtin import builtin_path

        return str(builtin_path(spec.removeprefix("builtin:")))
    if spec.startswith("demo:"):
        return str(demo_models_dir() / spec.removeprefix("demo:"))
    if spec.startswith("models:"):
        return str(models_dir() / spec.removeprefix("models:"))
    path = Path(spec).expanduser()
    if not path.is_absolute():
        path = (relative_to or Path.cwd()) / path
    return str(path.resolve())


def find_profile_file(name_or_path: str | os.PathLike) -> Path:
    """The .toml file a profile name or path refers to (ProfileError listing names if none)."""
    text = str(name_or_path)
    as_path = Path(text).expanduser()
    if text.endswith(".toml") or os.sep in text and not text.startswith("generated/"):
        if as_path.is_file():
            return as_path.resolve()
        if (shipped_dir() / text).is_file():  # 'cpu-demo.toml' means the shipped one
            return shipped_dir() / text
        raise ProfileError(f"profile file not found: {as_path}")
    candidate = shipped_dir() / f"{text}.toml"
    if candidate.is_file():
        return candidate
    names = available_profiles()
    close = difflib.get_close_matches(text, names, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ProfileError(
        f"unknown profile '{text}'.{hint} Available profiles: {', '.join(names)}. "
        "Or pass the path of a .toml file (scripts/autotune.py writes one for this machine)."
    )


def load_profile(
    name_or_path: str | os.PathLike,
    *,
    target: str | None = None,
    minions: Iterable[str] | None = None,
    tier: str | None = None,
) -> Profile:
    """Read, validate and resolve a profile.

    name_or_path: a shipped name (see available_profiles()) or a .toml path.
    target: use this model instead of the profile's target (its known dims are dropped).
    minions: use these models instead of the profile's minions ('ngram' = the n-gram minion).
    tier: override target.tier ('device', 'ram' or 'disk').
    Returns a Profile whose target.path and minions[i].path are absolute.
    """
    path = find_profile_file(name_or_path)
    text = path.read_text()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ProfileError(f"{path}: not valid TOML: {err}") from err
    data.setdefault("name", _profile_name(path))
    data = apply_overrides(data, target=target, minions=minions, tier=tier)
    try:
        profile = Profile.model_validate(data)
    except ValidationError as err:
        raise ProfileError(_explain(err, path, text)) from None
    profile = _resolve_paths(profile, relative_to=path.parent)
    profile._source = str(path)
    return profile


def _profile_name(path: Path) -> str:
    return f"generated/{path.stem}" if path.parent == generated_dir() else path.stem


def apply_overrides(data: dict[str, Any], *, target, minions, tier) -> dict[str, Any]:
    """A profile's raw TOML data with the command line's --target/--minion/--tier applied."""
    if target is not None:
        section = dict(data.get("target", {}))
        section["path"] = _from_command_line(str(target))
        section["format"] = "gguf" if str(target).endswith(".gguf") else "hf"
        section.pop("dims", None)  # they described the profile's model, not this one
        data["target"] = section
    if tier is not None:
        data.setdefault("target", {})["tier"] = tier
    if minions is not None:
        data["minions"] = [_minion_override(m, data) for m in minions]
    return data


def _minion_override(spec: str, data: dict[str, Any]) -> dict[str, Any]:
    if spec == "ngram":
        return {"kind": "ngram"}
    from minions_local.models.drafter import weights_named

    weights = weights_named(spec)
    if weights is not None:  # the feature drafter trained for the built-in target, or a file
        return {"kind": "eagle", **({"path": _from_command_line(weights)} if weights else {})}
    kind = "gguf" if spec.endswith(".gguf") else "hf"
    spec = _from_command_line(spec)
    # Keep how the profile ran minions of this kind on this machine (quantization,
    # device), which suits the hardware, but not its dims, which suit other models.
    like = next((m for m in data.get("minions", []) if m.get("kind", "hf") == kind), {})
    keep = {k: like[k] for k in ("quantization", "device", "dtype", "backend") if k in like}
    return {**keep, "kind": kind, "path": spec}


def _from_command_line(spec: str) -> str:
    """A path typed on the command line is relative to the working directory, not to
    the profile file; 'builtin:', 'demo:' and 'models:' references keep their meaning."""
    if spec.startswith(("builtin:", "demo:", "models:")):
        return spec
    return str(Path(spec).expanduser().resolve())


def _resolve_paths(profile: Profile, relative_to: Path) -> Profile:
    target = profile.target.model_copy(
        update={"path": resolve_model_path(profile.target.path, relative_to)}
    )
    minions = [_resolve_minion(m, target, relative_to) for m in profile.minions]
    return profile.model_copy(update={"target": target, "minions": minions})


def _resolve_minion(minion, target, relative_to: Path):
    """A minion with an absolute path; one made from the target's weights (a substitute,
    a self-draft) defaults to the target's path and known dims."""
    update: dict[str, Any] = {}
    if minion.path:
        update["path"] = resolve_model_path(minion.path, relative_to)
    elif minion.kind in OF_THE_TARGET:
        update["path"] = target.path
    if (minion.kind in OF_THE_TARGET or minion.kind == "eagle") and minion.dims is None and target.dims is not None:
        update["dims"] = target.dims  # made for the target: its shape
    return minion.model_copy(update=update) if update else minion


# -- error messages ---------------------------------------------------------------------


def _explain(err: ValidationError, path: Path, text: str) -> str:
    lines = [f"{path}: invalid profile"]
    errors = err.errors()
    # A misspelt required field also reports the real one as missing: say it once.
    misspelt = set()
    for e in errors:
        if e["type"] == "extra_forbidden":
            parent = [str(p) for p in e["loc"][:-1]]
            close = difflib.get_close_matches(str(e["loc"][-1]), _valid_fields(parent), n=1, cutoff=0.5)
            misspelt.update((tuple(e["loc"][:-1]), c) for c in close)
    for e in errors:
        if e["type"] == "missing" and (tuple(e["loc"][:-1]), e["loc"][-1]) in misspelt:
            continue
        loc = [str(p) for p in e["loc"]]
        dotted = _dotted(loc)
        where = _line_of(text, loc)
        prefix = f"  line {where}: " if where else "  "
        if e["type"] == "extra_forbidden":
            valid = _valid_fields(loc[:-1])
            close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
            hint = f" — did you mean '{close[0]}'?" if close else ""
            lines.append(
                f"{prefix}unknown field '{dotted}'{hint} (valid here: {', '.join(valid)})"
            )
        elif e["type"] == "missing":
            lines.append(f"{prefix}missing required field '{dotted}'")
        else:
            got = e.get("input")
            shown = f" (got {got!r})" if not isinstance(got, (dict, list)) else ""
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{prefix}{dotted or 'profile'}: {msg}{shown}")
    return "\n".join(lines)


def _dotted(loc: list[str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if part.isdecimal() else (f".{part}" if out else part)
    return out


def _valid_fields(loc: list[str]) -> list[str]:
    """Field names of the section at `loc` (a path through Profile's nested models)."""
    model: type[BaseModel] = Profile
    for part in loc:
        if part.isdecimal():
            continue
        field = model.model_fields.get(part)
        inner = _model_in(field.annotation) if field else None
        if inner is None:
            return []
        model = inner
    return list(model.model_fields)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _line_of(text: str, loc: list[str]) -> int | None:
    """Best-effort line number of the key at `loc`, searched under its table header."""
    if not loc or loc[-1].isdecimal():
        return None
    start = 0
    for i, part in enumerate(loc[:-1]):
        if part.isdecimal():
            continue
        index = int(loc[i + 1]) if i + 1 < len(loc) - 1 and loc[i + 1].isdecimal() else 0
        header = re.compile(rf"^\s*\[\[?[\w.]*\b{re.escape(part)}\]\]?\s*$", re.M)
        for _ in range(index + 1):
            m = header.search(text, start)
            if not m:
                break
            start = m.end()
    m = re.compile(rf"^\s*{re.escape(loc[-1])}\s*=", re.M).search(text, start)
    return text.count("\n", 0, m.start()) + 1 if m else None


__all__ = [
    "Profile",
    "available_profiles",
    "load_profile",
    "models_dir",
    "resolve_model_path",
]
