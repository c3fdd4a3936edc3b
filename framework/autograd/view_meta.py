"""How a view was made, where that forbids writing through it (PyTorch's ``CreationMeta``).

A view tensor records how to replay it from its base in ``_view_fn`` (see
``framework.autograd.function._compose_view_fn``): an inplace op through the view, or on
its base, rebuilds history from that replay (PyTorch's CopySlices). Some views cannot
be replayed, and PyTorch refuses to write through them while autograd is recording:

- :class:`UntrackedView`: the view was made while autograd was not recording (under
  ``no_grad`` or ``inference_mode``), or is a view of such a view, so its chain was never
  recorded. It also remembers the storage's version when it was made: once the view or
  its base has been written since, reading its ``grad_fn`` (which every op that records
  history does) raises while the base requires grad, as PyTorch's version check does;
- :class:`ForbiddenReplay` with ``creation="multi_output"``: one of several views a
  single op returned (``unbind``, ``split``, ``chunk``, ``split_with_sizes``);
- :class:`ForbiddenReplay` with ``creation="custom_function"``: a view returned by a
  :class:`framework.autograd.Function` (or an input it returned as-is), whose backward
  is the user's and cannot be replayed.

:func:`rebase_message` builds PyTorch's error text for each case (from
``handle_view_on_rebase`` in ``torch/csrc/autograd/variable.cpp``).
"""

from __future__ import annotations

_SUFFIX = {
    "multi_output": (
        " This view is the output of a function that returns multiple views. Such functions do not"
        " allow the output views to be modified inplace. You should replace the inplace operation by an"
        " out-of-place one."
    ),
    "no_grad": (
        " Given that this use case is ambiguous and error-prone, it is forbidden."
        " You can clarify your code by moving both the view and the inplace either both"
        " inside the no_grad block (if you don't want the inplace to be tracked) or both outside (if you want"
        " the inplace to be tracked)."
    ),
    "inference_mode": (
        " Given that this use case is ambiguous and error-prone, it is forbidden."
        " You can clarify your code by moving both the view and the inplace either both"
        " inside the inference_mode block (if you don't want the inplace to be tracked) or both outside (if you"
        " want the inplace to be tracked)."
    ),
    "custom_function": (
        " This view was created inside a custom Function (or because an input was returned as-is) and the"
        " autograd logic to handle view+inplace would override the custom backward associated with the custom"
        " Function, leading to incorrect gradients. This behavior is forbidden. You can fix this by"
        " cloning the output of the custom Function."
    ),
}


def rebase_message(creation: str, grad_fn_name: str | None, output_nr: int = 0, indirect: bool = False) -> str:
    """PyTorch's error for rewriting the history of a view that forbids it.

    Args:
        creation: ``"no_grad"``, ``"inference_mode"``, ``"multi_output"`` or ``"custom_function"``.
        grad_fn_name: the name of the view's own grad_fn, or None when it has none.
        output_nr: which output of that node the view is.
        indirect: the write went to the base or to another view of it (the view's
            history is being rebuilt), not to this view.
    """
    modified = "its base or another view of its base has been" if indirect else "is being"
    if creation in ("no_grad", "inference_mode") or grad_fn_name is None:
        prefix = (
            f"Output {output_nr} of {grad_fn_name} is a view of a view which was created in"
            if grad_fn_name is not None
            else "A view was created in"
        )
        if creation == "inference_mode":
            msg = f"{prefix} inference mode and {modified} modified inplace in normal mode."
        else:
            msg = f"{prefix} no_grad mode and {modified} modified inplace with grad mode enabled."
    else:
        msg = f"Output {output_nr} of {grad_fn_name} is a view and {modified} modified inplace."
    return msg + _SUFFIX[creation]


class ForbiddenReplay:
    """The ``_view_fn`` of a view whose history an inplace op must not rewrite.

    Calling it (the replay that rebuilds a view's history after its base changed)
    raises PyTorch's "indirect" error; the inplace check reads ``creation`` and raises
    the direct one before anything is written.
    """

    __slots__ = ("creation", "node_name", "output_nr")

    def __init__(self, creation: str, node_name: str | None, output_nr: int = 0):
        self.creation = creation
        self.node_name = node_name
        self.output_nr = output_nr

    def __call__(self, base):
        raise RuntimeError(rebase_message(self.creation, self.node_name, self.output_nr, indirect=True))

    def describe(self, grad_fn_name: str | None) -> tuple:
        """``(name, output_nr)`` to report for a view whose own grad_fn is ``grad_fn_name``:
        a view of such a view is output 0 of its own node, as PyTorch reports it."""
        if grad_fn_name is None or grad_fn_name == self.node_name:
            return self.node_name if grad_fn_name is not None else None, self.output_nr
        return grad_fn_name, 0


class UntrackedView(ForbiddenReplay):
    """The ``_view_fn`` of a view made while autograd was not recording (``creation``:
    ``"no_grad"`` or ``"inference_mode"``), or of a view of such a view.

    ``version`` is the storage's version when the view was made (PyTorch's
    ``attr_version``): :meth:`stale` says whether the view or its base has been written
    since, which makes its history ambiguous.
    """

    __slots__ = ("version",)

    def __init__(self, creation: str, version: int):
        # Made for every view under no_grad: the fields are set here, without super().
        self.creation = creation
        self.node_name = None
        self.output_nr = 0
        self.version = version

    def stale(self, view) -> bool:
        """Whether ``view`` (or its base) was written since the view was made."""
        return view._vc.value != self.version
