"""Hardware profiles: schema, loading and path resolution, model dimensions.

Pure data, no torch, near the bottom of the layers (offload reads it). What a profile
*means* (its memory plan, the cost model's prior, `--plan`) needs offload and
speculation, so it lives above them, in `minions_local.planning`.
"""

from minions_local.profile.dims import ModelDims, bytes_per_param, dims_for
from minions_local.profile.loader import available_profiles, load_profile, models_dir, resolve_model_path
from minions_local.profile.schema import Hardware, KnownDims, MinionSection, Profile, Speculation, TargetSection

__all__ = [
    "Hardware",
    "KnownDims",
    "MinionSection",
    "ModelDims",
    "Profile",
    "Speculation",
    "TargetSection",
    "available_profiles",
    "bytes_per_param",
    "dims_for",
    "load_profile",
    "models_dir",
    "resolve_model_path",
]
