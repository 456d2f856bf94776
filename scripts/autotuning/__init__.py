"""autotune's machinery (scripts/autotune.py): `measure` (one function per figure),
`sweep` (what each mode measures, with progress) and `output` (the profile written,
the summary printed)."""
