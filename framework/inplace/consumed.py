"""What stays of a tensor after an inplace SITE wrote its result over it.

A site of the policy (``nn.ReLU()``, a residual add, InPlace-ABN, ``Dropout``, an op that
policy ``auto`` rewrote) may write its result into its input's memory. It then returns a
NEW tensor object for the result, and the input's old object is *consumed*: its ``_data``
becomes a :class:`ConsumedData`, which still answers for the metadata (shape, dtype, ...)
but raises :class:`ConsumedTensorError` on any use of the values. So a program that reads
a tensor after a site overwrote it stops with an error that names the site and the line,
instead of computing with values that are not the ones it holds under policy ``off``.

Explicit inplace calls (``x.add_(y)``, ``nn.ReLU(inplace=True)``, ``x[i] = v``) keep
PyTorch's meaning: the tensor changes and stays usable. Only sites consume.
"""

from __future__ import annotations


class ConsumedTensorError(RuntimeError):
    """A tensor was used after an inplace site wrote its result over it."""


class ConsumedData:
    """Stands in for the array of a consumed tensor.

    Metadata stays readable (``t.shape``, ``t.dtype``, ``t.ndim``, ``t.numel()``, and the
    tensor's ``repr``), so debuggers and notebooks keep working; anything that would read
    the values (an op, ``.numpy()``, ``.item()``, indexing, NumPy functions, backward)
    raises :class:`ConsumedTensorError` with the site, its file and line, and the fix.
    """

    __slots__ = ("shape", "dtype", "ndim", "size", "itemsize", "nbytes", "site", "where", "policy")

    def __init__(self, array, site: str, where, policy: str):
        self.shape = array.shape
        self.dtype = array.dtype
        self.ndim = array.ndim
        self.size = array.size
        self.itemsize = array.itemsize
        self.nbytes = array.nbytes
        self.site = site
        self.where = where  # (file, line) of the call that consumed the tensor
        self.policy = policy

    def describe(self) -> str:
        file, line = self.where
        return f"{self.site} at {file}:{line}"

    def error(self) -> ConsumedTensorError:
        file, line = self.where
        return ConsumedTensorError(
            f"this tensor ({self.dtype} of shape {tuple(self.shape)}) was consumed by the inplace "
            f"site {self.site} at {file}:{line} (policy '{self.policy}'): the site wrote its result "
            "over the tensor's memory, so its values are gone. Use the tensor the site returned; "
            "or pass input.clone() to the site; or run with inplace policy 'auto' (writes in place "
            "only where nothing reads the input again) or 'off'."
        )

    # Every way to reach the values raises the same error.
    def __getattr__(self, name):
        raise self.error()

    def _raise(self, *args, **kwargs):
        raise self.error()

    __array__ = __array_ufunc__ = __array_function__ = __getitem__ = __setitem__ = _raise
    __len__ = __iter__ = __bool__ = __float__ = __int__ = __index__ = _raise
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _raise
    __matmul__ = __rmatmul__ = __pow__ = __neg__ = __abs__ = _raise
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _raise
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<consumed by {self.describe()}>"
