"""The backward engine: runs nodes in dependency order and accumulates gradients.

Gradients travel as raw arrays. Each node runs once, after every gradient for its
output has arrived (dependency counting over the part of the graph reachable from the
roots). A leaf likewise receives ONE summed gradient per backward, once its last
incoming edge has run, so its hooks and post-accumulate hooks run once (PyTorch's
AccumulateGrad). Without ``retain_graph`` a node frees its saved tensors right after its
backward, so activation memory falls as backward proceeds.

Gradient accumulation is an inplace site of the policy: under ``on`` and ``auto`` a
second gradient is added into the first one's buffer when the engine can prove that
buffer is its own (it owns its memory and no other reference to it exists: Paddle's
``use_count == 1`` rule, with the reference count measured at import); otherwise, and
always under ``off``, the sum is a new array. A leaf's first gradient is stolen into ``.grad`` under
the same proof and copied otherwise, so ``.grad`` never aliases another gradient.
"""

from __future__ import annotations

import sys

from .. import inplace, memory
from ..backend import get_array_module
from . import node as _node  # _node.capture: the recorder of framework.compile, or None
from .grad_mode import enable_grad, no_grad, state
from .node import Node, _as_array


def _count(array) -> int:  # the twin of _is_exclusive, measured at import
    return sys.getrefcount(array)


def _measure_one_local() -> int:
    import numpy as np  # noqa: PLC0415

    held = np.zeros(1)
    return _count(held)


# What an array counts inside _is_exclusive when nothing but the caller's one local
# variable refers to it: that variable, the argument (and on 3.10 the caller's value
# stack) and getrefcount's own. Measured, not assumed, on the running interpreter.
_ONE_LOCAL = _measure_one_local()


def _is_exclusive(array) -> bool:
    """True when nothing refers to ``array`` or its memory but the caller's one local.

    The caller must hold the array in exactly one local variable and in no container
    (:func:`_sum_into` and :func:`_accumulate_leaf` take it out of theirs first), so the
    count is the same on every interpreter and at every call site.
    """
    return array.base is None and sys.getrefcount(array) <= _ONE_LOCAL


def _sum_into(store, key, new) -> None:
    """``store[key] += new``: in place into ``store[key]``'s buffer under the policy when
    the engine alone holds it (Paddle's ``use_count == 1`` rule), else a new array."""
    if _node.capture is not None:
        return _node.capture.sum_into(store, key, new)
    if _node.graph_mode:  # create_graph: tensors, summed out of place with history
        store[key] = store[key] + new
        return
    existing = store[key]
    store[key] = None  # now only this local refers to it, unless someone else does
    if inplace.enabled() and _is_exclusive(existing):
        get_array_module(existing).add(existing, new, out=existing)
        memory.count("inplace_grad_accumulations")
        inplace.count_owned("grad_accumulation", existing.nbytes)
    else:
        existing = memory.track(_as_array(existing + new), "gradients")
    store[key] = existing


def _run_leaf_hooks(leaf, grad):
    """A leaf's tensor hooks, in order; a returned tensor replaces the gradient."""
    if _node.graph_mode:
        return _node.higher.run_leaf_hooks(leaf, grad)
    if leaf._hooks:
        for hook in tuple(leaf._hooks):
            r = hook(leaf._from_array(grad))
            if r is not None:
                grad = r._data
    return grad


def _accumulate_leaf(leaf, box) -> None:
    """Adds the gradient in ``box`` (a list it pops it from, so that this function's
    local is its only holder) into ``leaf.grad``, runs the leaf's hooks around it."""
    if _node.capture is not None:
        return _node.capture.accumulate_leaf(leaf, box)
    if _node.graph_mode:
        return _node.higher.accumulate_leaf(leaf, box.pop())
    grad = box.pop()
    if not leaf._requires_grad:
        # A view made under no_grad of a tensor that requires grad reports
        # requires_grad=True (PyTorch's rule) but has no history and no accumulator:
        # like PyTorch, the gradient that reaches it goes nowhere.
        return
    if leaf._hooks:
        hooked = _run_leaf_hooks(leaf, grad)
        if hooked is not grad:
            # A hook's tensor may be held by whoever made it: never adopt it as .grad.
            hooked = hooked.copy()
        grad = hooked
        del hooked
    if grad.shape != leaf._data.shape:
        raise RuntimeError(f"gradient of shape {grad.shape} for a leaf of shape {leaf._data.shape}")
    if grad.dtype != leaf._data.dtype:
        grad = grad.astype(leaf._data.dtype)
    current = leaf._grad
    if current is None:
        # PyTorch's AccumulateGrad: the gradient is adopted when nobody else holds it and it
        # has the leaf's layout (the leaf's strides where it is dense, else contiguous);
        # otherwise copied into that layout (a transposed leaf gets a transposed .grad)
        if _is_exclusive(grad) and memory.obeys_layout(grad, leaf._data):
            memory.track(grad, "gradients")
        else:
            grad = memory.copy_to_layout(grad, leaf._data, "gradients")
        leaf._grad = leaf._from_array(grad)
    elif inplace.enabled():
        # Like PyTorch's AccumulateGrad: .grad is updated in place (its version bumps).
        get_array_module(grad).add(current._data, grad, out=current._data)
        current._vc.bump("grad accumulation", ("<autograd engine>", 0))
        memory.count("inplace_grad_accumulations")
        inplace.count_owned("grad_accumulation", grad.nbytes)
    else:
        # out of place (policy off), in the leaf's layout as the inplace sum keeps it
        total = memory.empty_layout(leaf._data, grad.dtype, "gradients")
        get_array_module(grad).add(current._data, grad, out=total)
        leaf._grad = leaf._from_array(total)
    if leaf._post_acc_hooks:
        for hook in tuple(leaf._post_acc_hooks):
            hook(leaf)


def _needed_nodes(root_nodes, node_targets, leaf_ids, run_targets):
    """The nodes that must run: those from which some target is reachable through their
    inputs (postorder DFS over a DAG). A target node receives its gradient but runs only
    when another target lies behind it (PyTorch's autograd.grad: the gradient flowing
    into the input is captured, its node is neither run nor freed), or, with
    ``run_targets`` (``backward(inputs=...)``, which retains the gradient of a non-leaf
    input as ``retain_grad`` does), always."""
    needed: dict = {}
    for r in root_nodes:
        stack = [(r, False)]
        while stack:
            n, done = stack.pop()
            if done:
                hit = run_targets and n in node_targets
                for c in n.next:
                    if c is None:
                        continue
                    if isinstance(c, Node):
                        hit = hit or needed.get(c, False) or c in node_targets
                    elif id(c) in leaf_ids:
                        hit = True
                needed[n] = hit
                continue
            if n in needed:
                continue
            needed[n] = False
            stack.append((n, True))
            for c in n.next:
                if isinstance(c, Node) and c not in needed:
                    stack.append((c, False))
    return needed


def _execute(roots, retain_graph: bool, targets=None, accumulate: bool = True, create_graph: bool = False):
    """Runs backward from ``roots`` = [(edge, grad array)].

    With ``targets``, only the part of the graph that reaches them runs; their
    gradients are returned (``accumulate=False``, autograd.grad) or accumulated into
    their ``.grad`` only (``backward(inputs=...)``).

    With ``create_graph`` the gradients are tensors and every node's backward records
    history (grad mode on, ``node.graph_mode`` set: saved tensors read back as tensors),
    so the gradients can be differentiated again. No gradient buffer is reused then:
    the gradients are tensors other nodes may have saved.

    The run is a ``node.GraphTask`` (``node.graph_task`` while it runs; a backward inside a
    backward is another): what a checkpoint recomputes is kept for one run, then dropped.
    """
    prev_mode, prev_task = _node.graph_mode, _node.graph_task
    _node.graph_mode = create_graph
    task = _node.graph_task = _node.GraphTask()
    try:
        return _run(roots, retain_graph, targets, accumulate, create_graph)
    finally:
        _node.graph_mode, _node.graph_task = prev_mode, prev_task
        task.finish()


def _run(roots, retain_graph, targets, accumulate, create_graph):
    for callback in _node.before_backward:
        callback()
    root_nodes = []
    for edge, _ in roots:
        if isinstance(edge, Node) and edge not in root_nodes:
            root_nodes.append(edge)

    leaf_ids = node_targets = needed = None
    captured = None
    if targets is not None:
        # target -> every position it holds in ``targets`` (grad(y, [x, x]) returns two)
        leaf_ids, node_targets = {}, {}
        for i, t in enumerate(targets):
            fn = t.grad_fn
            if fn is None:
                leaf_ids.setdefault(id(t), []).append(i)
            else:
                node_targets.setdefault(fn, []).append(i)
        needed = _needed_nodes(root_nodes, node_targets, leaf_ids, accumulate)
        captured = [None] * len(targets)

    # Dependency counts over the reachable (and, with targets, needed) part of the graph.
    # Leaves are counted too: like PyTorch's AccumulateGrad, a leaf used several times gets
    # ONE sum, so its hooks and post-accumulate hooks run once, with the whole gradient.
    deps: dict = {}
    leaf_pending: dict = {}  # id(leaf) -> [leaf, edges still to arrive, summed gradient]
    seen = set(root_nodes)
    stack = list(root_nodes)

    def count_leaf(leaf):
        entry = leaf_pending.get(id(leaf))
        if entry is None:
            leaf_pending[id(leaf)] = [leaf, 1, None]
        else:
            entry[1] += 1

    for edge, _ in roots:
        if not isinstance(edge, Node):
            count_leaf(edge)
    while stack:
        node = stack.pop()
        if needed is not None and not needed.get(node):
            continue  # a target that does not run (or a root that reaches none): no edge of its counts
        for nxt in node.next:
            if isinstance(nxt, Node):
                if needed is None or needed.get(nxt) or nxt in node_targets:
                    deps[nxt] = deps.get(nxt, 0) + 1
                    if nxt not in seen:
                        seen.add(nxt)
                        stack.append(nxt)
            elif nxt is not None:
                count_leaf(nxt)

    def deliver_leaf(leaf, box):
        # The summed gradient travels in ``box`` (its pending entry), never as an
        # argument: _accumulate_leaf pops it and can then prove it may adopt it.
        if targets is None:
            _accumulate_leaf(leaf, box)
            return
        positions = leaf_ids.get(id(leaf))
        if positions is None:
            return
        if accumulate:
            _accumulate_leaf(leaf, box)
        else:
            g = _run_leaf_hooks(leaf, box.pop())  # autograd.grad runs them too (PyTorch)
            for i in positions:
                captured[i] = g

    def arrive_leaf(leaf, grads_in, i):
        # Takes grads_in[i] out of its list, so that once the sum is complete only the
        # pending entry refers to it.
        g = grads_in[i]
        grads_in[i] = None
        entry = leaf_pending[id(leaf)]
        if g is not None:
            if entry[2] is None:
                entry[2] = g
            else:
                _sum_into(entry, 2, g)
            del g
        entry[1] -= 1
        if entry[1] == 0:
            del leaf_pending[id(leaf)]
            if entry[2] is not None:
                deliver_leaf(leaf, entry)

    grads: dict = {}
    anomaly = state.anomaly
    track = memory.track
    may_reuse = inplace.enabled() and not create_graph  # the policy cannot change while backward runs
    reused = 0
    with memory.category("gradients"), enable_grad() if create_graph else no_grad():
        for edge, g in roots:
            track(g, "gradients")
            if not isinstance(edge, Node):
                arrive_leaf(edge, [g], 0)
            elif edge in grads:
                grads[edge] = grads[edge] + g if create_graph else _as_array(grads[edge] + g)
            else:
                grads[edge] = g
        ready = [n for n in root_nodes if deps.get(n, 0) == 0]
        while ready:
            node = ready.pop()
            g = grads.pop(node, None)
            outs = None
            runs = needed is None or needed.get(node)
            if g is not None and (runs or node in node_targets):
                for hook in node.__dict__.get("_pre_hooks", ()):
                    r = hook(g)
                    if r is not None:
                        g = r
                if node_targets is not None and node in node_targets:
                    for i in node_targets[node]:
                        captured[i] = g
            if not runs:
                continue  # a target whose inputs lead to no other target: captured, not run nor freed
            if g is not None:
                # An inplace site of the policy: under on/auto, when nothing but this local
                # refers to the incoming gradient (it is dead once the node has run),
                # elementwise backwards write their result into it (Paddle's use_count == 1).
                # Shared gradients (Add passes one array to both inputs), views and
                # gradients a hook kept are never reused.
                if create_graph and not node.differentiable_backward:
                    raise RuntimeError(
                        f"{node.name()} has no differentiable backward: create_graph=True (higher-order "
                        "gradients) through it is not supported"
                    )
                reuse = may_reuse and _is_exclusive(g)
                reused += reuse
                node.reuse_grad = reuse
                try:
                    outs = list(node.run_backward(g) if _node.capture is None else _node.capture.run_backward(node, g))
                    # Count the new gradients now, while the incoming one is still alive:
                    # that overlap is part of backward's real peak.
                    for out in outs:
                        if out is not None:
                            track(out, "gradients")
                    del out
                except Exception as e:
                    if anomaly and getattr(node, "_trace", None):
                        raise type(e)(f"{e}\n\nThe forward call of {node.name()} was:\n" + "".join(node._trace)) from e
                    raise
                del g  # lets the last consumer of a passed-through gradient own it
                if not retain_graph:
                    node.release()
                if anomaly == "nan":
                    _check_nan(node, outs)
            for i, nxt in enumerate(node.next):
                if nxt is None:
                    if outs is not None:
                        outs[i] = None
                    continue
                if not isinstance(nxt, Node):
                    arrive_leaf(nxt, outs or [None] * (i + 1), i)
                    continue
                gi = None
                if outs is not None:
                    gi = outs[i]
                    outs[i] = None
                if needed is not None and not needed.get(nxt) and nxt not in node_targets:
                    continue
                if gi is not None:
                    if nxt in grads:
                        _sum_into(grads, nxt, gi)
                    else:
                        grads[nxt] = gi
                n = deps[nxt] - 1
                deps[nxt] = n
                if n == 0:
                    ready.append(nxt)
                del gi
    if reused:
        memory.count("backward_grad_reuse", reused)
    return captured


def _check_nan(node, outs) -> None:
    for i, g in enumerate(outs):
        if g is not None and _is_tensor(g):
            g = g._data
        if g is not None and get_array_module(g).isnan(g).any():
            trace = "".join(getattr(node, "_trace", ()) or ())
            raise RuntimeError(
                f"Function '{node.name()}' returned nan values in its {i}th output."
                + (f"\n\nThe forward call that created it was:\n{trace}" if trace else "")
            )


def _is_tensor(x) -> bool:
    """A tensor, told apart without importing the class (it lives above this layer)."""
    return hasattr(x, "_from_array") and hasattr(x, "grad_fn")


def _roots(tensors, grad_tensors, create_graph=False):
    roots = []
    for k, (t, g) in enumerate(zip(tensors, grad_tensors)):
        if not _is_tensor(t):
            raise TypeError(f"backward expects tensors, got {type(t).__name__}")
        if not t.requires_grad:
            raise RuntimeError(f"element {k} of tensors does not require grad and does not have a grad_fn")
        xp = get_array_module(t._data)
        if g is None:
            if t._data.size != 1:
                raise RuntimeError(
                    f"grad can be implicitly created only for scalar outputs (got shape {t.shape}); "
                    "pass a gradient of the same shape to backward(gradient=...)"
                )
            g = xp.ones(t._data.shape, dtype=t._data.dtype)
            if _node.capture is not None:
                _node.capture.root_grad(g)
        else:
            given = g
            g = g._data if _is_tensor(g) else xp.asarray(g, dtype=t._data.dtype)
            if g.shape != t._data.shape:
                raise RuntimeError(f"gradient has shape {g.shape}, but the output has shape {t._data.shape}")
            if create_graph and _is_tensor(given):
                g = given  # the gradient's own history is part of the new graph (PyTorch)
        if create_graph and not _is_tensor(g):
            g = _node.higher.constant(g)
        fn = t.grad_fn
        roots.append((fn if fn is not None else t, g))
    return roots


def _as_list(x):
    if x is None:
        return None
    return [x] if _is_tensor(x) else list(x)


def _check_create_graph(create_graph) -> None:
    if create_graph and _node.capture is not None:
        raise RuntimeError(
            "create_graph=True is not supported inside a compiled step (fw.compile): run the "
            "higher-order backward eagerly, outside the compiled function"
        )


def backward(
    tensors, grad_tensors=None, retain_graph: bool | None = None, create_graph: bool = False, inputs=None
) -> None:
    """Accumulates the gradients of ``tensors`` into the ``.grad`` of the leaves.

    Args:
        tensors: a tensor or a sequence of them (scalars, unless ``grad_tensors`` is given).
        grad_tensors: the gradient of each tensor (``None`` means 1 for a scalar).
        retain_graph: keep saved tensors so backward can run through the graph again
            (defaults to ``create_graph``, as in PyTorch).
        create_graph: record the backward pass, so that the ``.grad`` it leaves can be
            differentiated again (higher-order gradients).
        inputs: accumulate only into these tensors' ``.grad``.
    """
    _check_create_graph(create_graph)
    if retain_graph is None:
        retain_graph = create_graph
    tensors = _as_list(tensors)
    grads = _as_list(grad_tensors) or [None] * len(tensors)
    if len(grads) != len(tensors):
        raise RuntimeError(f"got {len(tensors)} tensors and {len(grads)} gradients")
    targets = _as_list(inputs)
    if targets is not None:
        if not targets:
            raise RuntimeError("`inputs` argument to `backward()` cannot be empty.")
        for t in targets:
            if not t.is_leaf:
                # As PyTorch: a non-leaf input retains its gradient in .grad, from now on
                # (retain_grad), and its node runs and is freed as in any backward.
                t.retain_grad()
    _execute(_roots(tensors, grads, create_graph), bool(retain_graph), targets, True, bool(create_graph))


def grad(
    outputs,
    inputs,
    grad_outputs=None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool | None = None,
    materialize_grads: bool = False,
):
    """Returns d(outputs)/d(inputs) as a tuple of tensors, without touching any ``.grad``.

    As ``torch.autograd.grad``: ``grad_outputs`` are the vectors of the vector-Jacobian
    product (None: 1 for scalar outputs); ``retain_graph`` defaults to ``create_graph``;
    with ``create_graph`` the returned gradients have history and can be differentiated
    again; ``allow_unused`` returns None for an input the outputs do not depend on
    (defaults to ``materialize_grads``), ``materialize_grads`` zeros instead. An input
    that is not a leaf gets the gradient flowing into it: its own node does not run
    (and is not freed) unless another input lies behind it.
    """
    if materialize_grads and allow_unused is False:
        raise ValueError(
            "Expected allow_unused to be True or not passed when materialize_grads=True, but got: allow_unused=False."
        )
    if allow_unused is None:
        allow_unused = materialize_grads
    _check_create_graph(create_graph)
    if retain_graph is None:
        retain_graph = create_graph
    outputs = _as_list(outputs)
    inputs = _as_list(inputs)
    for t in inputs:
        if not t.requires_grad:
            raise RuntimeError("One of the differentiated Tensors does not require grad")
    gouts = _as_list(grad_outputs) or [None] * len(outputs)
    if len(gouts) != len(outputs):
        raise RuntimeError(f"grad requires one grad_output per output: got {len(outputs)} outputs and {len(gouts)}")
    captured = _execute(_roots(outputs, gouts, create_graph), bool(retain_graph), inputs, False, bool(create_graph))
    result = []
    for k, t in enumerate(inputs):
        g = captured[k]
        captured[k] = None  # this local alone holds it: it may be adopted without a copy
        if g is None and not allow_unused:
            raise RuntimeError(
                "One of the differentiated Tensors appears to not have been used in the graph. "
                "Set allow_unused=True if this is the desired behavior."
            )
        if g is None and materialize_grads:
            zeros = t._from_array(memory.zeros(t.shape, t.dtype, get_array_module(t._data), "gradients"))
            zeros._requires_grad = bool(create_graph)  # PyTorch's zeros_like(input, requires_grad=create_graph)
            result.append(zeros)
        elif g is None or create_graph:
            result.append(g)  # a tensor with history: returned as is (PyTorch)
        else:
            result.append(t._from_array(g if _is_exclusive(g) else g.copy()))
    return tuple(result)
