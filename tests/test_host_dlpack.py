"""hbfp.host.dlpack: DLPack import without copies (bf16 through our own capsule reader),
lifetime of the producer's memory, export back to torch, and clear errors."""

import ctypes
import gc

import ml_dtypes
import numpy as np
import pytest
from hbfp.host import NotSupported
from hbfp.host import dlpack as D

torch = pytest.importorskip("torch")


def base_ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def check_view(view: np.ndarray, tensor) -> None:
    """``view`` shows ``tensor``'s values in ``tensor``'s memory, with its strides."""
    assert view.shape == tuple(tensor.shape)
    assert view.strides == tuple(s * tensor.element_size() for s in tensor.stride())
    assert base_ptr(view) == tensor.data_ptr()
    if tensor.dtype == torch.bfloat16:
        assert view.dtype == ml_dtypes.bfloat16
        want = tensor.view(torch.int16).numpy().view(np.uint16) if tensor.is_contiguous() else \
            tensor.contiguous().view(torch.int16).numpy().view(np.uint16)
        np.testing.assert_array_equal(view.view(np.uint16), want)
    else:
        np.testing.assert_array_equal(view, tensor.numpy())


def bf16_tensor(*shape):
    return (torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape) - 7).bfloat16()


# ---- import from torch -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16,
                                   torch.int32, torch.int8, torch.uint8])
@pytest.mark.parametrize("make", [
    lambda t: t,                             # contiguous 3-D
    lambda t: t.reshape(-1),                 # 1-D
    lambda t: t[0],                          # 2-D
    lambda t: t.transpose(0, 2),             # strided (transposed)
    lambda t: t[1:, :, 1::2],                # sliced: storage offset and a step
    lambda t: t.permute(2, 0, 1)[1:3, :, 1], # everything at once
    lambda t: t[0, 0, 0],                    # 0-d
    lambda t: t[:, :0],                      # empty
], ids=["3d", "1d", "2d", "transposed", "sliced", "mixed", "scalar", "empty"])
def test_views_of_torch_tensors(dtype, make):
    t = make((torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4) - 5).to(dtype))
    v = D.to_numpy(t)
    if t.numel():
        check_view(v, t)
    else:
        assert v.shape == tuple(t.shape) and v.dtype.itemsize == t.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_copy_both_ways(dtype):
    t = bf16_tensor(3, 5).to(dtype)
    sub = t[1:, ::2]
    v = D.to_numpy(sub)
    t[2, 4] = 100.0  # the producer writes: the view sees it
    assert float(v[1, 2]) == 100.0
    v[0, 0] = -3.0   # the view writes: the producer sees it
    assert float(t[1, 0]) == -3.0


def test_bf16_lifetime_keeps_producer_memory():
    t = bf16_tensor(64, 33)
    want = t.float().numpy()[::2, 1:]
    v = D.to_numpy(t[::2, 1:])
    w = v[1:, ::3]  # a view of the view keeps it alive too
    del t
    gc.collect()
    np.testing.assert_array_equal(v.astype(np.float32), want)
    del v
    gc.collect()
    _ = torch.zeros(64, 33, dtype=torch.bfloat16) + 1  # reuse freed memory, if any were freed
    np.testing.assert_array_equal(w.astype(np.float32), want[1:, ::3])


def test_bf16_capsule_is_marked_used():
    t = bf16_tensor(4)
    held = [t.__dlpack__(max_version=(1, 0))]

    class Once:
        def __dlpack__(self, **kwargs):
            return held[0]

        def __dlpack_device__(self):
            return (1, 0)

    v = D.to_numpy(Once())
    assert "used_dltensor_versioned" in repr(held[0])
    with pytest.raises(ValueError, match="not an unused DLPack capsule"):
        D.to_numpy(Once())
    held.clear()
    gc.collect()
    np.testing.assert_array_equal(v.view(np.uint16), t.view(torch.int16).numpy().view(np.uint16))


def test_legacy_producer():
    """A producer without ``max_version`` gives a "dltensor" capsule."""
    t = bf16_tensor(2, 3).t()

    class Legacy:
        def __dlpack__(self, stream=None):
            return t.__dlpack__()

        def __dlpack_device__(self):
            return t.__dlpack_device__()

    v = D.to_numpy(Legacy())
    check_view(v, t)
    assert v.flags.writeable


def test_numpy_arrays_pass_through():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert D.to_numpy(a) is a
    b = a.astype(ml_dtypes.bfloat16)[:, ::2]
    assert D.to_numpy(b) is b
    # NumPy does not export ml_dtypes.bfloat16 through DLPack (yet): arrays pass as they are.
    with pytest.raises(BufferError):
        b.__dlpack__()


def test_other_dlpack_producers_through_numpy():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)[:, 1:]

    class Producer:  # any __dlpack__ object, not an ndarray
        def __dlpack__(self, **kwargs):
            return a.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return a.__dlpack_device__()

    v = D.to_numpy(Producer())
    assert base_ptr(v) == base_ptr(a) and v.strides == a.strides
    np.testing.assert_array_equal(v, a)


def test_not_an_array():
    with pytest.raises(TypeError, match="DLPack producer"):
        D.to_numpy([1.0, 2.0])


# ---- unsupported tensors -----------------------------------------------------------------


@pytest.mark.parametrize("dtype, name", [(torch.complex64, "complex64"), (torch.bool, "bool"),
                                         (torch.float8_e4m3fn, "float8_e4m3fn ")])
def test_unsupported_dtypes(dtype, name):
    t = torch.zeros(3).to(dtype)
    with pytest.raises(TypeError, match=f"unsupported DLPack dtype {name}"):
        D.to_numpy(t, "A")
    # the refused capsule was left to its producer: the tensor still exports
    assert t.__dlpack__() is not None


def test_device_checked_before_export():
    class OnCuda:
        exported = False

        def __dlpack__(self, **kwargs):
            OnCuda.exported = True
            raise AssertionError("must not export")

        def __dlpack_device__(self):
            return (2, 0)

    with pytest.raises(NotSupported, match="CUDA device") as e:
        D.to_numpy(OnCuda(), "B")
    assert isinstance(e.value, ValueError) and "B:" in str(e.value)
    assert not OnCuda.exported


# A producer of our own, for what torch never exports: lying devices, lanes, read-only
# flags, and deleters we can count.

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_NAMES = {True: b"dltensor_versioned", False: b"dltensor"}


class FakeProducer:
    def __init__(self, storage: np.ndarray, shape, strides=None, offset=0, *, device=(1, 0),
                 dtype=(4, 16, 1), versioned=True, flags=0, claim_device=(1, 0)):
        self.storage, self.deleted = storage, 0
        self.claim_device, self.versioned = claim_device, versioned
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.strides = None if strides is None else (ctypes.c_int64 * len(strides))(*strides)
        self.deleter = D._Deleter(self._delete)
        cls = D._DLManagedTensorVersioned if versioned else D._DLManagedTensor
        self.managed = m = cls()
        if versioned:
            m.version.major, m.version.minor, m.flags = 1, 0, flags
        m.deleter = self.deleter
        t = m.dl_tensor
        t.data = base_ptr(storage)
        t.device.device_type, t.device.device_id = device
        t.ndim = len(shape)
        t.dtype.code, t.dtype.bits, t.dtype.lanes = dtype
        t.shape = self.shape
        t.strides = self.strides
        t.byte_offset = offset

    def _delete(self, ptr):
        assert ptr == ctypes.addressof(self.managed)
        self.deleted += 1

    def __dlpack__(self, **kwargs):
        return _PyCapsule_New(ctypes.addressof(self.managed), _NAMES[self.versioned], None)

    def __dlpack_device__(self):
        return self.claim_device


@pytest.mark.parametrize("versioned", [True, False])
def test_fake_producer_strides_offset_and_deleter(versioned):
    bits = np.arange(100, dtype=np.uint16)
    # a 3 x 4 view starting at element 5, rows 20 apart, every other column
    p = FakeProducer(bits, (3, 4), (20, 2), 10, versioned=versioned)
    v = D.to_numpy(p)
    assert v.dtype == ml_dtypes.bfloat16 and v.flags.writeable
    np.testing.assert_array_equal(v.view(np.uint16), np.add.outer([5, 25, 45], [0, 2, 4, 6]))
    assert p.deleted == 0
    w = v.T
    del v
    gc.collect()
    assert p.deleted == 0
    del w
    gc.collect()
    assert p.deleted == 1


def test_fake_producer_compact_strides_and_read_only():
    bits = np.arange(24, dtype=np.uint16)
    p = FakeProducer(bits, (2, 3, 4), None, flags=1)
    v = D.to_numpy(p)
    np.testing.assert_array_equal(v.view(np.uint16), bits.reshape(2, 3, 4))
    assert not v.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        v[0, 0, 0] = 1
    del v
    gc.collect()
    assert p.deleted == 1


def test_fake_producer_empty_releases_at_once():
    p = FakeProducer(np.zeros(1, np.uint16), (0, 3))
    v = D.to_numpy(p)
    assert v.shape == (0, 3) and v.dtype == ml_dtypes.bfloat16 and p.deleted == 1


@pytest.mark.parametrize("kwargs, error, match", [
    ({"device": (2, 0)}, NotSupported, "CUDA device"),         # lies in __dlpack_device__
    ({"dtype": (4, 16, 4)}, TypeError, "lanes=4"),
    ({"dtype": (4, 32, 1)}, TypeError, "bfloat32"),
    ({"dtype": (5, 64, 1)}, TypeError, "complex64"),
])
def test_fake_producer_errors(kwargs, error, match):
    p = FakeProducer(np.zeros(4, np.uint16), (4,), **kwargs)
    with pytest.raises(error, match=match):
        D.to_numpy(p)
    assert p.deleted == 0  # not consumed: the capsule's destructor would own the cleanup


# ---- back to the caller's type -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_round_trip_to_torch(dtype):
    t = bf16_tensor(4, 6).to(dtype)[1:, ::2]
    v = D.to_numpy(t)
    back = D.from_numpy_like(v, torch.zeros(1))
    assert isinstance(back, torch.Tensor) and back.dtype == dtype
    assert back.data_ptr() == t.data_ptr() and back.stride() == t.stride()
    assert torch.equal(back, t)


def test_from_numpy_like_bf16_and_copies_only_when_needed():
    a = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    like = torch.zeros(1, dtype=torch.bfloat16)
    t = D.from_numpy_like(a, like)
    assert t.dtype == torch.bfloat16 and t.data_ptr() == base_ptr(a)
    assert torch.equal(t.float(), torch.arange(12.0).reshape(3, 4))
    r = a[::-1, ::-1]  # torch has no negative strides: copied
    t = D.from_numpy_like(r, like)
    assert torch.equal(t.float(), torch.from_numpy(np.ascontiguousarray(r.astype(np.float32))))
    ro = np.arange(3, dtype=np.float32)
    ro.flags.writeable = False
    assert D.from_numpy_like(ro, like).data_ptr() == base_ptr(ro)


def test_from_numpy_like_numpy():
    a = np.ones(3, np.float32)
    assert D.from_numpy_like(a, np.zeros(1)) is a
    assert D.from_numpy_like(a, None) is a
