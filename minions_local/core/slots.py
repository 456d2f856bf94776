"""Per-request state held inside a model backend: one *slot* per request.

Several requests share one target pass (continuous batching), and each keeps its own
KV cache in the target and its own caches and tables in every minion. The weights are
shared; the state is not. A backend keeps the state of the slot in use in its ordinary
attributes, so every single-request code path (prefill, grow, verify, commit) works on
it unchanged, and `use_slot` swaps those attributes with another slot's.

Slot 0 is what a backend holds from its start: the engine's conversation (whose cache
a chat turn reuses). Batch requests take slots from 1 up, so a batch job never
disturbs the conversation's cache.
"""

from __future__ import annotations

from typing import Any


class SlotStates:
    """Swap a backend's per-request attributes between slots.

    Each class names its own attributes in `SLOT_FIELDS` (the fields of every class
    in the MRO count) and says how a new slot starts in `fresh_slot_state` (empty
    caches; cooperative: a subclass adds to what `super()` gives); `release_slot_state`
    frees what a dropped slot held outside Python (a llama.cpp context, say). The slot
    in use lives in the attributes themselves; the others wait in `_parked`.
    """

    SLOT_FIELDS: tuple[str, ...] = ()

    def slot_fields(self) -> tuple[str, ...]:
        """Every per-request attribute, from every class in the MRO."""
        seen: dict[str, None] = {}
        for cls in reversed(type(self).__mro__):
            seen.update(dict.fromkeys(cls.__dict__.get("SLOT_FIELDS", ())))
        return tuple(seen)

    def fresh_slot_state(self) -> dict[str, Any]:
        """The attributes of a slot that has seen nothing yet."""
        return {}

    def release_slot_state(self, state: dict[str, Any]) -> None:
        """Free what a dropped slot's attributes hold beyond memory Python reclaims."""

    @property
    def slot(self) -> int:
        """The slot whose state the backend's attributes hold now."""
        return self.__dict__.get("_slot", 0)

    def use_slot(self, slot: int) -> None:
        """Make `slot` the state that prefill/grow/verify/commit/reset act on (a new
        slot starts empty)."""
        if slot < 0:
            raise ValueError(f"slot must be >= 0, got {slot}")
        current = self.slot
        if slot == current:
            return
        parked = self.__dict__.setdefault("_parked", {})
        parked[current] = {name: getattr(self, name) for name in self.slot_fields()}
        state = parked.pop(slot, None)
        if state is None:
            state = self.fresh_slot_state()
        for name, value in state.items():
            setattr(self, name, value)
        self._slot = slot

    def drop_slot(self, slot: int) -> None:
        """Forget `slot`'s state (its request ended). Dropping the slot in use empties
        it instead (its attributes must always hold some state)."""
        if slot == self.slot:
            old = {name: getattr(self, name) for name in self.slot_fields()}
            for name, value in self.fresh_slot_state().items():
                setattr(self, name, value)
            self.release_slot_state(old)
            return
        state = self.__dict__.get("_parked", {}).pop(slot, None)
        if state is not None:
            self.release_slot_state(state)

    def parked_states(self) -> list[dict[str, Any]]:
        """The attributes of every slot other than the one in use (read them, never
        keep them: they are the slots' own objects)."""
        return list(self.__dict__.get("_parked", {}).values())

    def slots_held(self) -> list[int]:
        """Every slot with state: the one in use and the parked ones."""
        return sorted({self.slot, *self.__dict__.get("_parked", {})})
