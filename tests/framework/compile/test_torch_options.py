"""``fw.compile`` takes ``torch.compile``'s ``fullgraph``, ``dynamic`` and ``mode``: the
values it honours run, the others raise (never accepted and then ignored)."""

from __future__ import annotations

import pytest

import framework as fw

from .helpers import bitwise_equal, make_model, run


@pytest.mark.parametrize(
    "options",
    [
        {"fullgraph": True},
        {"dynamic": False},
        {"dynamic": None, "mode": "default"},
        {"mode": "reduce-overhead"},
        {"fullgraph": True, "dynamic": False, "mode": None},
    ],
)
def test_options_it_honours_compile_and_replay_as_eager(options):
    eager_losses, eager_states, _ = run("mlp", "off", False, 3)
    losses, states, compiled = run("mlp", "off", True, 3, **options)
    assert [x.tobytes() for x in losses] == [x.tobytes() for x in eager_losses]
    assert all(bitwise_equal(a, b) for a, b in zip(states, eager_states))
    assert compiled.report()["replays"] >= 1


@pytest.mark.parametrize(
    "options, message",
    [
        ({"fullgraph": False}, "fullgraph=False\\) is not supported: a step is captured whole"),
        ({"dynamic": True}, "dynamic=True\\) is not supported: a program is specialized to its input shapes"),
        ({"mode": "max-autotune"}, "mode='max-autotune'\\) is not supported: fw.compile does not autotune"),
        ({"mode": "max-autotune-no-cudagraphs"}, "mode='max-autotune-no-cudagraphs'\\) is not supported"),
        ({"mode": "reduce-overhead", "cuda_graph": False}, "contradicts cuda_graph=False"),
    ],
)
def test_options_it_cannot_honour_raise(options, message):
    model = make_model("mlp")
    with pytest.raises(ValueError, match=message):
        fw.compile(lambda x: model(x).sum(), **options)
    with pytest.raises(ValueError, match=message):  # as a decorator too
        fw.compile(**options)
