"""Hardware profiles: schema, loading and path resolution, model dimensions.

The lowest layer of the package: pure data, no torch. `minions_local.profile.cli` is the
public facade (it adds `plan_report`, which needs the planner and the cost model).
"""

from minions_local.profile.dims import ModelDims, bytes_per_param, dims_for
from minions_local.profile.loader import available_profiles, load_profile, models_dir, resolve_model_path
from minions_local.profile.schema import Hardware, KnownDims, Minion, Profile, Speculation, Target

__all__ = [
    "Hardware",
    "KnownDims",
    "Minion",
    "ModelDims",
    "Profile",
    "Speculation",
    "Target",
    "available_profiles",
    "bytes_per_param",
    "dims_for",
    "load_profile",
    "models_dir",
    "resolve_model_path",
]
