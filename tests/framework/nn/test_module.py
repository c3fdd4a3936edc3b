"""nn.Module and nn.Parameter: registration, traversal, modes, state dicts, devices, repr."""

import copy
import pickle
from collections import OrderedDict

import numpy as np
import pytest

import framework as fw
from framework import memory, nn
from framework.testing import assert_close


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.scale = nn.Parameter(fw.ones(4))
        self.register_buffer("count", fw.zeros(1))
        self.register_buffer("scratch", fw.zeros(2), persistent=False)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(x)) * self.scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 2, bias=False)

    def forward(self, x):
        return self.head(self.bn(self.block(x)))


# --- Parameter ------------------------------------------------------------------------------


def test_parameter_is_a_leaf_sharing_memory_counted_as_parameters():
    t = fw.randn(50, 10)
    before = memory.breakdown()["parameters"]
    p = nn.Parameter(t)
    assert isinstance(p, fw.Tensor) and p.is_leaf and p.requires_grad
    assert p._data is t._data and p._vc is t._vc  # as t.detach(): same memory and version
    assert memory.breakdown()["parameters"] - before == t.nbytes
    assert not nn.Parameter(fw.zeros(2), requires_grad=False).requires_grad
    with pytest.raises(TypeError, match="expects a Tensor"):
        nn.Parameter(np.zeros(3))
    with pytest.raises(RuntimeError, match="floating point"):
        nn.Parameter(fw.zeros(2, dtype=fw.int64))
    assert repr(nn.Parameter(fw.tensor([1.0, 2.0]))).startswith("Parameter containing:\ntensor([1., 2.]")


def test_parameter_data_setter_keeps_object_and_counts_new_buffer():
    p = nn.Parameter(fw.zeros(3))
    new = fw.ones(100)
    p.data = new
    assert p.shape == (100,) and p._data is new._data and memory.is_tracked(p._data)
    del new
    before = memory.breakdown()["parameters"]
    p.data = fw.ones(200)
    assert memory.breakdown()["parameters"] - before == 200 * 4 - 100 * 4


def test_parameter_deepcopy_and_pickle():
    p = nn.Parameter(fw.randn(3, 2))
    p.grad = fw.ones(3, 2)
    for q in (copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
        assert type(q) is nn.Parameter and q.requires_grad
        assert q._data is not p._data
        assert_close(q.detach(), p.detach())
    assert copy.deepcopy(p).grad is not None


# --- registration and traversal --------------------------------------------------------------


def test_registration_order_and_names():
    net = Net()
    # module by module (pre-order), each module's own parameters first: PyTorch's order
    assert [n for n, _ in net.named_parameters()] == [
        "block.scale",
        "block.fc.weight",
        "block.fc.bias",
        "bn.weight",
        "bn.bias",
        "head.weight",
    ]
    assert [n for n, _ in net.named_buffers()] == [
        "block.count",
        "block.scratch",
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
    ]
    assert [n for n, _ in net.named_children()] == ["block", "bn", "head"]
    assert [n for n, _ in net.named_modules()] == ["", "block", "block.fc", "block.act", "bn", "head"]
    assert len(list(net.modules())) == 6 and list(net.children())[1] is net.bn
    assert [n for n, _ in net.block.named_parameters(recurse=False)] == ["scale"]
    assert [n for n, _ in net.named_parameters(prefix="model")][0] == "model.block.scale"
    assert net.get_submodule("block.fc") is net.block.fc
    with pytest.raises(AttributeError, match="no submodule"):
        net.get_submodule("block.nope")
    assert net.head.bias is None and "bias" in net.head._parameters


def test_shared_parameters_and_modules_appear_once():
    lin = nn.Linear(2, 2)
    seq = nn.Sequential(lin, nn.ReLU(), lin)
    assert len(list(seq.parameters())) == 2
    assert len(list(seq.modules())) == 3
    tied = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    tied[1].weight = tied[0].weight
    assert len(list(tied.parameters())) == 3


def test_setattr_rules():
    m = nn.Module()
    m.w = nn.Parameter(fw.zeros(2))
    with pytest.raises(TypeError, match="cannot assign 'Tensor' as parameter 'w'"):
        m.w = fw.zeros(2)
    m.w = None  # a placeholder, like a missing bias
    assert m.w is None and list(m.parameters()) == []
    m.sub = nn.Linear(1, 1)
    with pytest.raises(TypeError, match="child module 'sub'"):
        m.sub = 3
    m.register_buffer("buf", fw.zeros(2))
    with pytest.raises(TypeError, match="as buffer 'buf'"):
        m.buf = 1.0
    m.buf = fw.ones(3)
    assert m.buf.shape == (3,) and "buf" in dict(m.named_buffers())
    with pytest.raises(KeyError, match="already exists"):
        m.register_buffer("sub", fw.zeros(1))
    with pytest.raises(KeyError, match="contain"):
        m.register_buffer("a.b", fw.zeros(1))
    with pytest.raises(TypeError, match="Tensor or None"):
        m.register_buffer("x", np.zeros(1))
    with pytest.raises(TypeError, match="nn.Parameter or None"):
        m.register_parameter("x", fw.zeros(1))
    m.plain = 5  # an ordinary attribute
    assert m.plain == 5 and "plain" not in m._parameters
    # A plain attribute can become a parameter (and leaves __dict__)
    m.plain = nn.Parameter(fw.zeros(1))
    assert "plain" in m._parameters and "plain" not in m.__dict__
    del m.plain
    assert "plain" not in m._parameters
    with pytest.raises(AttributeError, match="has no attribute 'missing'"):
        m.missing  # noqa: B018

    class Early(nn.Module):
        def __init__(self):
            self.w = nn.Parameter(fw.zeros(1))

    with pytest.raises(AttributeError, match="before Module.__init__"):
        Early()


def test_buffers_are_counted_as_parameters_memory():
    before = memory.breakdown()["parameters"]
    m = nn.Module()
    m.register_buffer("stat", fw.zeros(1000))
    assert memory.breakdown()["parameters"] - before == 4000


def test_train_eval_propagate():
    net = Net()
    assert all(m.training for m in net.modules())
    assert net.eval() is net
    assert not any(m.training for m in net.modules())
    net.block.train()
    assert net.block.fc.training and not net.bn.training and not net.training
    net.train()
    assert all(m.training for m in net.modules())
    with pytest.raises(ValueError, match="boolean"):
        net.train("yes")


def test_zero_grad_set_to_none_or_zeros():
    net = Net()
    net(fw.randn(5, 3)).sum().backward()
    grads = {n: p.grad for n, p in net.named_parameters()}
    assert all(g is not None for g in grads.values())
    net.zero_grad(set_to_none=False)
    for n, p in net.named_parameters():
        assert p.grad is grads[n]  # same tensor, zeroed in place
        assert not p.grad.numpy().any()
    net.zero_grad()
    assert all(p.grad is None for p in net.parameters())


def test_forward_hooks():
    lin = nn.Linear(2, 2)
    seen = []
    h1 = lin.register_forward_pre_hook(lambda m, args: seen.append(("pre", args[0].shape)))
    h2 = lin.register_forward_hook(lambda m, args, out: out * 0)
    out = lin(fw.ones(3, 2))
    assert seen == [("pre", (3, 2))] and not out.detach().numpy().any()
    h1.remove()
    h2.remove()
    assert lin(fw.ones(3, 2)).detach().numpy().any() and len(seen) == 1


def test_apply_and_requires_grad_():
    net = Net()
    names = []
    net.apply(lambda m: names.append(type(m).__name__))
    assert names[-1] == "Net" and names.count("Linear") == 2
    net.requires_grad_(False)
    assert not any(p.requires_grad for p in net.parameters())


# --- devices and dtypes ----------------------------------------------------------------------


def test_to_double_keeps_parameter_objects():
    net = Net()
    params = list(net.parameters())
    net(fw.randn(4, 3)).sum().backward()
    assert net.double() is net
    assert [id(p) for p in net.parameters()] == [id(p) for p in params]
    assert all(p.dtype == np.float64 and p.grad.dtype == np.float64 for p in net.parameters())
    assert net.bn.running_mean.dtype == np.float64
    assert net.bn.num_batches_tracked.dtype == np.int64  # integer buffers keep their dtype
    assert all(type(p) is nn.Parameter and memory.is_tracked(p._data) for p in net.parameters())
    assert net(fw.randn(4, 3, dtype=fw.float64)).dtype == np.float64
    net.to(fw.float32)
    assert all(p.dtype == np.float32 for p in net.parameters())
    assert net.to("cpu") is net
    with pytest.raises(TypeError, match="floating point"):
        net.to(dtype=fw.int64)


def test_half_float_double_cast_floating_parameters_grads_and_buffers():
    # PyTorch's Module.half/float/double: floating parameters, their grads and floating
    # buffers change dtype in place of the module; num_batches_tracked stays int64
    net = Net()
    net(fw.randn(4, 3)).sum().backward()
    assert net.half() is net
    assert all(p.dtype == np.float16 and p.grad.dtype == np.float16 for p in net.parameters())
    assert net.bn.running_var.dtype == np.float16 and net.bn.num_batches_tracked.dtype == np.int64
    net.float()
    assert all(p.dtype == np.float32 and p.grad.dtype == np.float32 for p in net.parameters())
    assert {b.dtype for b in net.buffers()} == {np.dtype(np.float32), np.dtype(np.int64)}


def test_module_casts_match_torch(torch):
    ours, theirs = nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3)
    for cast in ("half", "double", "float"):
        getattr(ours, cast)(), getattr(theirs, cast)()
        for (name, b), (tname, tb) in zip(ours.state_dict().items(), theirs.state_dict().items()):
            assert name == tname and str(b.dtype) == str(tb.dtype).removeprefix("torch."), cast


@pytest.mark.gpu
def test_to_cuda_and_back():
    net = Net().cuda()
    assert all(p.device.type == "cuda" for p in net.parameters())
    assert all(b.device.type == "cuda" for b in net.buffers())
    out = net(fw.randn(4, 3, device="cuda"))
    out.sum().backward()
    sd = net.state_dict()
    net2 = Net()
    net2.load_state_dict(sd)  # GPU values into a CPU model
    net.cpu()
    for (_, a), (_, b) in zip(net.state_dict().items(), net2.state_dict().items()):
        assert_close(a, b)


# --- state dict --------------------------------------------------------------------------------


def test_state_dict_round_trip_with_buffers():
    fw.manual_seed(0)
    src = Net()
    src(fw.randn(8, 3))  # training step: running stats and num_batches_tracked change
    sd = src.state_dict()
    assert list(sd) == [
        "block.scale",
        "block.count",
        "block.fc.weight",
        "block.fc.bias",
        "bn.weight",
        "bn.bias",
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
        "head.weight",
    ]  # the non-persistent buffer is left out
    assert all(not t.requires_grad for t in sd.values())
    assert sd["bn.running_mean"]._data is src.bn.running_mean._data  # shares memory, as PyTorch
    assert int(sd["bn.num_batches_tracked"].item()) == 1

    fw.manual_seed(1)
    dst = Net()
    weight = dst.block.fc.weight
    v0 = weight._version
    result = dst.load_state_dict(copy.deepcopy(sd))
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert dst.block.fc.weight is weight and weight._version == v0 + 1  # copied in place
    for k, v in dst.state_dict().items():
        assert_close(v, sd[k])
        assert v._data is not sd[k]._data
    x = fw.randn(6, 3)
    src.eval()
    dst.eval()
    assert_close(dst(x), src(x))


def test_state_dict_keep_vars_and_numpy_values():
    net = nn.Linear(2, 3)
    sd = net.state_dict(keep_vars=True)
    assert sd["weight"] is net.weight
    other = nn.Linear(2, 3)
    other.load_state_dict({k: v.detach().numpy().astype(np.float64) for k, v in sd.items()})
    assert other.weight.dtype == np.float32
    assert_close(other.weight.detach(), net.weight.detach())


def test_load_state_dict_reports_every_problem_in_one_message():
    net = Net()
    sd = net.state_dict()
    del sd["block.scale"]
    del sd["bn.running_var"]
    sd["extra.weight"] = fw.zeros(2)
    sd["head.weight"] = fw.zeros(5, 4)
    with pytest.raises(RuntimeError) as e:
        net.load_state_dict(sd)
    msg = str(e.value)
    assert msg.startswith("Error(s) in loading state_dict for Net:")
    assert 'Missing key(s) in state_dict: "block.scale", "bn.running_var".' in msg
    assert 'Unexpected key(s) in state_dict: "extra.weight".' in msg
    assert (
        "size mismatch for head.weight: copying a param with shape (5, 4) from checkpoint, "
        "the shape in current model is (2, 4)."
    ) in msg


def test_load_state_dict_strict_false():
    net = Net()
    before = net.block.scale.detach().clone()
    sd = net.state_dict()
    fresh = Net()
    sd2 = {k: v.clone() for k, v in fresh.state_dict().items() if k != "block.scale"}
    sd2["unknown"] = fw.zeros(1)
    result = net.load_state_dict(sd2, strict=False)
    assert result.missing_keys == ["block.scale"] and result.unexpected_keys == ["unknown"]
    assert_close(net.block.scale.detach(), before)  # missing: left as it was
    assert_close(net.head.weight.detach(), fresh.head.weight.detach())
    assert repr(nn.Linear(1, 1).load_state_dict(nn.Linear(1, 1).state_dict())) == "<All keys matched successfully>"
    # size mismatches raise even when not strict
    sd["head.weight"] = fw.zeros(1, 1)
    with pytest.raises(RuntimeError, match="size mismatch for head.weight"):
        net.load_state_dict(sd, strict=False)
    with pytest.raises(TypeError, match="dict-like"):
        net.load_state_dict([1, 2])


# --- containers and repr -------------------------------------------------------------------------


def test_sequential_and_module_list():
    a, b, c = nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)
    seq = nn.Sequential(a, b, c)
    assert len(seq) == 3 and seq[0] is a and seq[-1] is c and list(seq) == [a, b, c]
    sub = seq[1:]
    assert isinstance(sub, nn.Sequential) and list(sub) == [b, c]
    x = fw.randn(4, 2)
    assert_close(seq(x), c(b(a(x))))
    named = nn.Sequential(OrderedDict([("first", a), ("second", c)]))
    assert [n for n, _ in named.named_children()] == ["first", "second"]
    seq.append(nn.Sigmoid())
    assert len(seq) == 4
    del seq[1]
    assert [n for n, _ in seq.named_children()] == ["0", "1", "2"] and seq[1] is c
    with pytest.raises(IndexError):
        seq[7]

    ml = nn.ModuleList([a, c])
    ml.append(b)
    ml.insert(0, nn.Identity())
    assert len(ml) == 4 and ml[1] is a and ml[-1] is b
    assert len(list(ml.parameters())) == 4
    ml += [nn.Tanh()]
    assert len(ml) == 5
    with pytest.raises(NotImplementedError):
        ml(x)


def test_repr_like_pytorch():
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8, 2),
        nn.Dropout(0.1),
    )
    assert repr(net) == (
        "Sequential(\n"
        "  (0): Conv2d(3, 8, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))\n"
        "  (1): BatchNorm2d(8, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)\n"
        "  (2): ReLU(inplace=True)\n"
        "  (3): MaxPool2d(kernel_size=2, stride=2, padding=0)\n"
        "  (4): Flatten(start_dim=1, end_dim=-1)\n"
        "  (5): Linear(in_features=8, out_features=2, bias=True)\n"
        "  (6): Dropout(p=0.1)\n"
        ")"
    )
    assert repr(Net()) == (
        "Net(\n"
        "  (block): Block(\n"
        "    (fc): Linear(in_features=3, out_features=4, bias=True)\n"
        "    (act): ReLU()\n"
        "  )\n"
        "  (bn): BatchNorm1d(4, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)\n"
        "  (head): Linear(in_features=4, out_features=2, bias=False)\n"
        ")"
    )


def test_deepcopy_gives_an_independent_equal_module():
    net = Net()
    twin = copy.deepcopy(net)
    assert type(twin.block.fc.weight) is nn.Parameter
    for (n, a), (m, b) in zip(net.state_dict().items(), twin.state_dict().items()):
        assert n == m and a._data is not b._data
        assert_close(a, b)
    with fw.no_grad():
        twin.head.weight.fill_(0)
    assert net.head.weight.detach().numpy().any()


def test_missing_forward_is_a_clear_error():
    with pytest.raises(NotImplementedError, match='missing the required "forward"'):
        nn.Module()(1)
