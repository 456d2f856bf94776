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
