"""What a profile means for memory and speed, and how many requests fit at once.

Above the profile data, offload and speculation, below the engine: the memory plan
(`memory_plan`), the cost model's prior (`cost_prior`), and `--plan`, which prints
them (`report`, `cli`; `python -m minions_local.planning --plan NAME`): arithmetic over
a profile's numbers, no torch, so a 70B profile plans on a laptop. `capacity` sizes a
batch, from the plan and from the loaded models' caches against the memory free.
"""
