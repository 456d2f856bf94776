"""scripts/gpu_check.py's parts: one lent GPU machine, one call, four steps.

env.py      the machine, and the pinned-RAM -> device copy peak
parting.py  where a speculative reply parts from the target alone's, and whether a
            near-tie explains it (used by tests/gpu and the chat step)
curve.py    the 70B-shaped stack's pass time by tree size and resident layers
plot.py     that curve beside the rtx4090-70b profile's projection, as a PNG
chat.py     an end-to-end speculative chat on the demo family
record.py   the result file, the code fingerprint, and docs/gpu/'s dated records
travel.py   what travels to the machine (at most 60 MiB) and the slim checkout for it
"""
