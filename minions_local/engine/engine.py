"""The public engine: load a target and its minions, generate, stream, chat.

One code path serves the TUI, the Python API and the benchmarks. `stream()` is a
generator of events (new text, one stats record per target pass, then the result);
`generate()` and `chat()` drain it. Between calls the engine keeps the KV caches
of the last sequence, so a chat turn (or any prompt that extends the previous one)
only runs its new tokens.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch

from minions_local.core.protocols import Minion
from minions_local.backends.hf import resolve_dtype
from minions_local.backends.llama_remote import RemoteLlamaTarget
from minions_local.backends.llama_target import LlamaTarget
from minions_local.core.errors import (ContextOverflowError, EngineBusyError, GenerationCancelled, MinionsError,
                                      RequestError)
from minions_local.core.events import DoneEvent, Event, Generation, LoadProgress, NoticeEvent
from minions_local.engine.loading import as_policy, load_minion, load_target, unique_names
from minions_local.speculation.budget import AdaptiveDepth, BudgetPolicy, FixedBudget
from minions_local.speculation.calibration import calibrate_policy
from minions_local.speculation.decode import Decoder, StepResult, snapshot
from minions_local.engine import request
from minions_local.engine.reply import PreparedRequest
from minions_local.engine.text import render_chat

Messages = Sequence[dict[str, str]]
T = TypeVar("T")


class Engine:
    """A target model, its minions and the decode loop between them.

    Build it with `Engine.from_pretrained(...)` or `Engine.from_profile(...)`.
    One generation at a time: a second one (or a `reset()`) while a generation holds
    the engine raises `EngineBusyError`. A `stream()` holds it from its first event
    until it ends, is closed, or is garbage-collected; `cancel()` from another thread
    ends it after the current target pass.
    """

    def __init__(self, decoder: Decoder, tokenizer, *, profile_name: str = "", memory_plan: Any = None) -> None:
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.profile_name = profile_name
        self.memory_plan = memory_plan
        self.context_length = decoder.target.context_length
        self._busy = threading.Lock()
        self._holder: _Holder | None = None
        self._cancel = threading.Event()
        self.eos_ids = _eos_ids(decoder.target, tokenizer)
        self._notices: list[str] = []

    # --- construction -----------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        target: str | Path,
        minions: Sequence[str | Path | Minion] = (),
        *,
        device: str = "cpu",
        dtype: torch.dtype | str | None = None,
        compute_dtype: torch.dtype | str | None = "auto",
        target_tier: str = "device",
        budget: int | str | BudgetPolicy = "adaptive",
        max_depth: int = 8,
        top_k: int = 8,
        selection: str = "learned",
        grow_ahead: bool | str = "auto",
        threads: int | None = None,
        progress: Callable[[LoadProgress], None] | None = None,
        stream_options: dict[str, Any] | None = None,
        rpc: Sequence[str] = (),
        rpc_split: Sequence[float] | None = None,
        profile_name: str = "",
        memory_plan: Any = None,
    ) -> Engine:
        """Load a target and minions from Hugging Face folders (minions may also be
        `.gguf` files or "ngram").

        budget: draft nodes verified per pass: an int (fixed), "adaptive" (depth follows
            acceptance), or a BudgetPolicy object. `minions=[]` decodes autoregressively.
        max_depth: deepest tree level (for a fixed budget; the adaptive start depth).
        top_k: children each minion considers per expanded node.
        selection: "learned" (vote weights follow acceptance; a minion whose marginal
            tokens are not worth its time sits out), "all" (weights learn, all run),
            "equal" (all run, equal votes).
        grow_ahead: let minions that can keep growing while the target verifies, giving
            the next step a head start (speculation/ahead.py); "auto": where the target's
            pass leaves them compute of their own.
        compute_dtype: what the target computes in: "auto" (`dtype`, except a streamed
            target's bf16 weights in float32 on a CPU without bf16 matmul kernels, where
            a bf16 tree pass costs about as many 1-token passes as it has rows; the
            layers still move as bf16), None (= dtype) or a dtype.
        threads: torch CPU threads (None keeps torch's default).
        stream_options: passed to the layer streamer when the target is streamed
            (quant, buffers, cache_dir, layer_tiers).
        rpc: RPC servers ("host:port", each running minions-rpc-server) that hold some of a
            GGUF target's layers (llama.cpp's RPC backend); the minions stay here.
        rpc_split: this machine's share of the layers, then each server's (default: in
            proportion to the memory each reports).
        """
        if rpc:
            stream_options = {**(stream_options or {}),
                              "rpc": {"servers": list(rpc), "shares": list(rpc_split) if rpc_split else None,
                                      "timeout": (stream_options or {}).get("rpc", {}).get("timeout")}}
        if threads:
            torch.set_num_threads(threads)
        torch_dtype = resolve_dtype(dtype)
        target_model, tokenizer = load_target(target, dtype=torch_dtype, device=device, tier=target_tier,
                                              progress=progress, stream_options=stream_options or {},
                                              compute_dtype=compute_dtype)
        loaded = [
            load_minion(spec, index=i, target_path=Path(target), target_tokenizer=tokenizer,
                        target_vocab=target_model.vocab_size, dtype=torch_dtype, device=device, progress=progress,
                        target=target_model)
            for i, spec in enumerate(minions)
        ]
        unique_names(loaded)
        policy = make_policy(budget, max_depth)
        # The minions' and the target's real price per pass.
        # A llama.cpp target that checked its rows at load timed passes of several sizes
        # doing so: at 8B under a memory limit each pass is seconds, none is run again.
        # A llama.cpp target whose cut was timed (llama_load.py) has its cut's passes,
        # scaled to its size (and, streamed, one pass of its own added for its reads).
        on_llama = isinstance(target_model, LlamaTarget)
        timed = target_model.first_passes if on_llama else ()
        if on_llama and target_model.pass_shape:  # (then the check's passes were the cut's)
            timed = target_model.pass_shape
        calibrate_policy(policy, loaded, target_model.vocab_size, progress, target=target_model,
                         target_warm_up=not on_llama,
                         target_repeats=2 if on_llama and target_model.new_shapes_cost_more else 1,
                         target_timed=timed)
        decoder = Decoder(target_model, loaded, policy, top_k=top_k, selection=selection, grow_ahead=grow_ahead)
        getattr(tokenizer, "prepare_renderer", lambda: None)()  # a GGUF's: after the timings, not beside them
        return cls(decoder, tokenizer, profile_name=profile_name, memory_plan=memory_plan)

    @classmethod
    def from_profile(cls, name_or_path: str | Path = "cpu-demo", *,
                     progress: Callable[[LoadProgress], None] | None = None, **overrides: Any) -> Engine:
        """Load what a hardware profile describes (see profiles/); keyword overrides
        (target=PATH, minions=[...], tier=..., and from_pretrained options) win."""
        from minions_local.engine.from_profile import engine_kwargs_from_profile, untaken_models_freed

        with untaken_models_freed():
            return cls.from_pretrained(progress=progress, **engine_kwargs_from_profile(name_or_path, **overrides))

    # --- information for callers ------------------------------------------------------

    @property
    def minion_names(self) -> list[str]:
        return [m.name for m in self.decoder.minions]

    @property
    def minions(self) -> list[Minion]:
        return self.decoder.minions

    def memory_by_tier(self) -> dict[str, int]:
        if self.memory_plan is not None and hasattr(self.memory_plan, "bytes_by_tier"):
            return dict(self.memory_plan.bytes_by_tier)
        from minions_local.engine.memory import measured_bytes_by_tier

        return measured_bytes_by_tier(self.decoder.target, self.minions)

    def memory_plan_text(self) -> str:
        if self.memory_plan is not None and hasattr(self.memory_plan, "format"):
            return self.memory_plan.format()
        from minions_local.engine.memory import describe_placement

        return describe_placement(self.decoder.target, self.minions)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise MinionsError("This target folder has no tokenizer, so text prompts cannot be encoded; "
                               "pass a list of token ids instead.")
        return list(self.tokenizer.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def reset(self) -> None:
        """Forget the cached conversation (the next prompt is prefilled from scratch).

        Raises EngineBusyError while a generation holds the engine: its caches are in use."""
        self._acquire("reset the engine")
        try:
            self.decoder.reset()
        finally:
            self._busy.release()

    def cancel(self) -> None:
        """Ask a running generation (in another thread) to stop after the current pass."""
        self._cancel.set()

    # --- generation -------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> Generation:
        """Generate a completion; see `stream` for the arguments."""
        return _drain(self.stream(prompt, **kwargs))

    def chat(self, messages: Messages, **kwargs: Any) -> Generation:
        """The assistant's reply to a conversation; see `stream` for the arguments."""
        return _drain(self.stream_chat(messages, **kwargs))

    def stream_chat(self, messages: Messages, **kwargs: Any) -> Iterator[Event]:
        """Like `stream`, for a list of {"role", "content"} messages. The prompt uses the
        tokenizer's chat template when it has one; earlier turns are not re-run."""
        return self.stream(self._chat_ids(messages), **kwargs)

    def _chat_ids(self, messages: Messages) -> list[int]:
        if self.tokenizer is None:
            raise MinionsError("chat needs a tokenizer, and the target folder has none.")
        checked = request.chat_messages(messages)
        text = _render(self.tokenizer, checked)
        templated = bool(getattr(self.tokenizer, "chat_template", None))
        return self.tokenizer.encode(text, add_special_tokens=not templated)

    def stream(self, prompt: str | Sequence[int], *, max_new_tokens: int | None = 256, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
               stop: str | Sequence[str] | None = None) -> Iterator[Event]:
        """Yield TokenEvent / StepEvent as target passes complete, then one DoneEvent.

        prompt: text or token ids. temperature 0 is greedy (token-identical to the
        target alone); otherwise samples exactly from the target's distribution after
        temperature, top_k (0 = off) and top_p. Without a seed the minions draw their
        drafts too (verified by recursive rejection sampling), which the target accepts
        far more often. With a seed the output repeats exactly, on any engine state:
        the drafts are then the minions' top tokens and every committed token is one
        seeded draw from the target, which costs acceptance (1.6-1.7 instead of 3.0-4.1
        tokens per pass on the demo family at temperature 0.7: scripts/bench.py acceptance).
        stop: strings that end the reply (not included). max_new_tokens=None: as many
        as the context window leaves. Every argument is checked before any work is done;
        a bad one (or a context overflow) raises RequestError / ContextOverflowError
        naming it, its value and what is allowed.
        """
        prepared = self.prepare(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=seed, stop=stop)
        from minions_local.engine.batch import run_requests

        # One request through the one decode loop (engine/batch.py), a run of one on
        # the conversation's slot: its caches stay for the next call. What the engine has
        # to tell first (a target reloaded after an RPC server was lost) comes before it.
        holder = _Holder()
        events = _events_only(run_requests(self, [prepared], 1, conversation=True, holder=holder),
                              self.take_notices())
        holder.stream = weakref.ref(events)
        return events

    def prepare(self, prompt: str | Sequence[int], *, max_new_tokens: int | None = 256, temperature: float = 0.0,
                top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                stop: str | Sequence[str] | None = None) -> PreparedRequest:
        """Check a request's arguments (see `stream`) without running anything: what
        `stream` decodes, and what a batch (`stream_batch`, the server) queues. A target that
        lost an RPC server holding its layers loads again first (`take_notices` says so)."""
        self._recover_target()
        params = request.sampling_params(temperature, top_p, top_k)
        max_new = request.max_new_tokens_arg(max_new_tokens)
        seed = request.seed_arg(seed)
        stops = request.stop_strings(stop)
        ids = request.prompt_ids(prompt, encode=self.encode, vocab_size=self.decoder.target.vocab_size,
                                 start_token=self._start_token())
        room = self.context_length - len(ids)
        if max_new is None and room >= 1:
            max_new = room
        if max_new is None or max_new > room:
            asked = "max_new_tokens" if max_new is None else f"max_new_tokens {max_new}"
            raise ContextOverflowError(
                f"The prompt is {len(ids)} tokens, which leaves {max(room, 0)} of the target's context window of "
                f"{self.context_length} tokens for {asked}. Shorten the prompt, lower max_new_tokens (/max in "
                f"the chat), or start a new conversation (/new).")
        return PreparedRequest(ids, params, max_new, seed, stops)

    def _recover_target(self) -> None:
        """Reload a target whose model was on a server lost mid-reply (backends/llama_remote.py)
        now, before the request is queued, unless a generation holds the engine (its next
        pass reloads it then, and the log says so)."""
        target = self.decoder.target
        if not isinstance(target, RemoteLlamaTarget) or target.lost is None or self._busy.locked():
            return
        notice = target.recover()
        if notice:
            self._notices.append(notice)

    def take_notices(self) -> list[str]:
        """What happened outside any reply since the last call (a reload and its time)."""
        notices, self._notices = self._notices, []
        return notices

    def prepare_chat(self, messages: Messages, **kwargs: Any) -> PreparedRequest:
        """`prepare` for a conversation (see `stream_chat`)."""
        return self.prepare(self._chat_ids(messages), **kwargs)

    # --- many requests at once (continuous batching) -----------------------------------

    def stream_batch(self, prompts: Sequence[str | Sequence[int]], *, parallel: int | None = None,
                     progress: bool | None = None, **kwargs: Any) -> Iterator[tuple[int, Event]]:
        """Decode many prompts together: up to `parallel` at a time share every target
        pass (their trees verified in one pass, a streamed target's reads paid once),
        and the rest join in order as others finish. Yields (prompt index, event): each
        prompt's events are those `stream` gives, in order, ending with its DoneEvent;
        different prompts' events interleave.

        Each reply is what its prompt gives alone: greedy replies are the same tokens,
        sampled ones follow the target's law, a seeded one repeats. The engine's
        conversation cache (slot 0) is left as it was.

        kwargs: as for `stream`, the same for every prompt; every prompt is checked
            before any work (an error names the prompt's index).
        parallel: requests decoding at once (default: `default_parallel()`).
        progress: a progress bar on stderr (default: for more than 4 prompts when stderr
            is a terminal).
        """
        prepared = [self._for_request(i, lambda p=p: self.prepare(p, **kwargs)) for i, p in enumerate(prompts)]
        return self._run_batch(prepared, parallel, progress)

    def stream_chat_batch(self, conversations: Sequence[Messages], *, parallel: int | None = None,
                          progress: bool | None = None, **kwargs: Any) -> Iterator[tuple[int, Event]]:
        """`stream_batch` for conversations (each a list of {"role", "content"})."""
        prepared = [self._for_request(i, lambda c=c: self.prepare_chat(c, **kwargs))
                    for i, c in enumerate(conversations)]
        return self._run_batch(prepared, parallel, progress)

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], **kwargs: Any) -> list[Generation]:
        """Every prompt's Generation, in input order (see `stream_batch`): the offline
        batch job, e.g. summarising a folder of documents with a model that does not fit."""
        from minions_local.engine.batch import collect

        return collect(self.stream_batch(prompts, **kwargs), len(prompts))

    def chat_batch(self, conversations: Sequence[Messages], **kwargs: Any) -> list[Generation]:
        """Every conversation's reply, in input order (see `stream_batch`)."""
        from minions_local.engine.batch import collect

        return collect(self.stream_chat_batch(conversations, **kwargs), len(conversations))

    def batch_run(self, parallel: int | None = None):
        """A continuous batch over this engine (engine/batch.py) for a caller that owns it
        (the server's scheduler): requests join with `admit` and decode with `step`."""
        from minions_local.engine.batch import BatchRun

        return BatchRun(self, parallel or self.default_parallel())

    def default_parallel(self) -> int:
        """Requests a batch runs at once by default: what memory allows for their caches
        (planning/capacity.py), at most 8 on a CPU and 16 on a GPU."""
        from minions_local.planning.capacity import requests_at_once

        return requests_at_once(self.decoder.target, self.minions, self.context_length, self.memory_plan)

    @staticmethod
    def _for_request(index: int, work: Callable[[], T]) -> T:
        """Run one request's checks; an error names the request's index."""
        try:
            return work()
        except MinionsError as err:
            err.args = (f"Request {index}: {err}", *err.args[1:])
            raise

    def _run_batch(self, prepared: list[PreparedRequest], parallel: int | None,
                   progress: bool | None) -> Iterator[tuple[int, Event]]:
        from minions_local.engine.batch import run_requests

        parallel = request.parallel_arg(parallel) if parallel is not None else self.default_parallel()
        show = progress if progress is not None else len(prepared) > 4 and sys.stderr.isatty()
        return run_requests(self, prepared, parallel, progress=show)

    def _start_token(self) -> int | None:
        """What an empty prompt starts from: the BOS token (id 0 is a token like any other)."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if isinstance(bos, int) and not isinstance(bos, bool):
            return bos
        return self.decoder.target.special_ids()[0]

    def _acquire(self, doing: str) -> None:
        if self._busy.acquire(blocking=False):
            return
        if self._paused_stream() is not None:
            # A stream() nobody reads any more holds the engine until it is closed; one caught
            # in a reference cycle is closed only when the cycle collector runs (0.5 s with
            # torch loaded, so only here): run it now.
            gc.collect()
            if self._busy.acquire(blocking=False):
                return
        raise EngineBusyError(self._busy_message(doing))

    def _paused_stream(self) -> Iterator[Event] | None:
        """The stream holding the engine, if it is suspended between events."""
        holder = self._holder
        events = holder.stream() if holder is not None and holder.stream is not None else None
        return events if events is not None and not events.gi_running else None

    def _busy_message(self, doing: str) -> str:
        holder = self._holder
        where = f" (started in thread {holder.thread!r})" if holder is not None else ""
        if self._paused_stream() is not None:
            return (f"Cannot {doing}: a stream() opened earlier{where} is paused, waiting for its caller to read "
                    f"on, and holds the engine until it ends. Read it to the end or close it (stream.close(), "
                    f"or open it with contextlib.closing); dropping every reference to it releases it too.")
        return (f"Cannot {doing}: a generation is running on this engine{where}. Wait for it to end, or call "
                f"engine.cancel() to stop it after its current target pass.")

    @contextlib.contextmanager
    def holding(self, doing: str, holder: _Holder | None = None) -> Iterator[None]:
        """Hold the engine while a generation or a batch runs (one at a time: a second
        caller gets EngineBusyError naming the holder); `cancel()` then asks the holder
        to stop. `doing` says what a second caller is refused; `holder`: the stream
        that holds it (for that caller's message)."""
        self._acquire(doing)
        holder = holder or _Holder()
        try:
            holder.thread = threading.current_thread().name
            self._holder = holder
            self._cancel.clear()
            yield
        finally:
            self._holder = None
            self._busy.release()

    @property
    def cancel_requested(self) -> bool:
        """Whether `cancel()` asked the running generation or batch to stop."""
        return self._cancel.is_set()

    def keep_tree(self, result: StepResult) -> None:
        """Attach a display copy of the verified tree to the step's record (the TUI's
        tree view), where the decoder keeps trees."""
        if self.decoder.keep_trees:
            result.record.tree = snapshot(result, self.minion_names, self._token_text)

    def _token_text(self, token: int) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode([token])


class _Holder:
    """Which stream holds the engine, for the message a second caller gets."""

    __slots__ = ("stream", "thread")

    def __init__(self) -> None:
        self.stream: weakref.ref | None = None
        self.thread = ""


def _render(tokenizer, messages: list[dict[str, Any]]) -> str:
    """The chat prompt; a template that refuses the conversation (roles out of order,
    a role it does not know) is a request error, with the template's own words."""
    try:
        from jinja2 import TemplateError
    except ImportError:  # transformers renders templates with jinja2; without it there are none
        TemplateError = ()  # type: ignore[assignment,misc]
    try:
        return render_chat(tokenizer, messages)
    except TemplateError as err:
        raise RequestError(f"The model's chat template refused these messages: {err}",
                           argument="messages") from None


def _eos_ids(target, tokenizer) -> set[int]:
    eos = None if tokenizer is None else tokenizer.eos_token_id
    return set(target.special_ids()[1]) | (set() if eos is None else {int(eos)})


def _events_only(tagged: Iterator[tuple[int, Event]], notices: Sequence[str] = ()) -> Iterator[Event]:
    """The notices, then a run's events without their request's tag; closed early, it
    closes the run (which ends the request and frees the engine at once)."""
    with contextlib.closing(tagged):
        for text in notices:
            yield NoticeEvent(text)
        for _, event in tagged:
            yield event


def _drain(events: Iterator[Event]) -> Generation:
    for event in events:
        if isinstance(event, DoneEvent):
            return event.generation
    raise GenerationCancelled("generation ended without a result")


def make_policy(budget: int | str | BudgetPolicy, max_depth: int) -> BudgetPolicy:
    if isinstance(budget, bool):
        raise ValueError("budget must be an int, 'adaptive' or a BudgetPolicy")
    if isinstance(budget, int):
        return FixedBudget(nodes=budget, depth=max_depth)
    if budget == "adaptive":
        return AdaptiveDepth(nodes=32, depth=min(6, max_depth), max_depth=max(max_depth, 16))
    if isinstance(budget, str):
        raise ValueError(f"budget must be an int, 'adaptive' or a BudgetPolicy, got {budget!r}")
    return as_policy(budget)
