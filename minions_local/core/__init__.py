"""What every layer speaks: errors, events and step records, memory tiers, the token tree and its
masks, sampling settings, and the `Target` and `Minion` protocols.

No model code and no I/O lives here; nothing here imports another layer.
"""
