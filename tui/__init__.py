"""minions-chat: the terminal chat for minions-local.

The app talks to the engine only through its stream API (`Engine.stream_chat`,
`Engine.stream`) and the plain records in `minions_local.core.events`. Nothing here
imports torch: the engine module is imported lazily, inside the loading thread.
"""
