"""bench_big_gguf.py's engine child runs ours on the peers' terms: the context size it is
given (llama.cpp's tools get the same -c), the kernel asked for, else cpu-demo as it ships."""

from __future__ import annotations


def test_the_childs_profile_holds_the_context_and_kernel_it_is_given():
    from benchmarks.engine_child import _profile
    from minions_local.profile.loader import load_profile

    assert _profile("auto") == "cpu-demo"
    shipped = load_profile("cpu-demo").target
    sized = load_profile(_profile("auto", 1024)).target
    assert sized.context_tokens == 1024 != shipped.context_tokens
    assert sized.gguf_kernel == shipped.gguf_kernel
    both = load_profile(_profile("dequant", 2048)).target
    assert (both.context_tokens, both.gguf_kernel) == (2048, "dequant")


def test_the_childs_profile_takes_speculation_settings():
    """A fixed tree against the cost model's choice: settings replace the profile's own
    (max_depth) or are added to its [speculation] (budget)."""
    from benchmarks.engine_child import _profile
    from minions_local.profile.loader import load_profile

    shipped = load_profile("cpu-demo").speculation
    fixed = load_profile(_profile("auto", 0, "adaptive=false,budget=24,max_depth=8")).speculation
    assert shipped.adaptive and shipped.max_depth != 8
    assert (fixed.adaptive, fixed.budget, fixed.max_depth) == (False, 24, 8)
    assert fixed.top_k == shipped.top_k


def test_the_load_is_set_against_llama_cpps_load_line_and_its_ready_time():
    """llama.cpp's 'load time' line counts its weights alone; its ready time (start to the
    prompt) holds its context's buffers and warm-up too, the span our load is timed over."""
    from bench_big_gguf import load_ratio, tool
    from benchmarks.llama_tools import ToolRun

    class NoLimit:
        peak = 0

    run = ToolRun(tokens=8, decode_seconds=2.0, prompt_seconds=0.5, load_seconds=6.0, wall_seconds=10.0)
    peer = tool(run, NoLimit())
    assert peer["ready_seconds"] == 7.5 and peer["load_seconds"] == 6.0
    ours = {"load_seconds": 12.0}
    assert load_ratio(ours, peer) == 2.0 and load_ratio(ours, peer, "ready_seconds") == 1.6
    assert load_ratio({}, peer) is None and load_ratio(ours, {"error": "no timings"}) is None
