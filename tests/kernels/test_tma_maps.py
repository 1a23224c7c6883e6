"""kernels/tma_maps.descriptor: a remembered descriptor serves a tensor only while the tensor
it was made over still lies at the remembered address (sleep mode without fixed addresses
moves cache storages; a descriptor follows its tensor's storage)."""

from __future__ import annotations

from flashpage.kernels.tma_maps import descriptor


class _Fake:
    """What descriptor() reads of a tensor, its address settable (a storage resized away
    and back, as sleep does)."""

    def __init__(self, name: str, ptr: int) -> None:
        self.name, self.ptr = name, ptr
        self.shape, self.dtype = (4, 16), "bf16"

    def data_ptr(self) -> int:
        return self.ptr

    def stride(self) -> tuple[int, int]:
        return (16, 1)


def test_a_moved_tensor_never_lends_its_descriptor_to_the_next_at_its_old_address():
    made: list[str] = []

    def make(t: _Fake) -> str:
        made.append(t.name)
        return f"over {t.name}"

    memo: dict = {}
    k3, k5 = _Fake("k3", 0x1000), _Fake("k5", 0x2000)
    assert descriptor(memo, "g16", k3, make) == "over k3"
    assert descriptor(memo, "g16", k3, make) == "over k3" and made == ["k3"]  # remembered
    k3.ptr, k5.ptr = 0x3000, 0x1000  # sleep and wake_up: k5's storage lands at k3's old address
    assert descriptor(memo, "g16", k5, make) == "over k5"
    assert descriptor(memo, "g16", k3, make) == "over k3"
    assert made == ["k3", "k5", "k3"]
    assert descriptor(memo, "g16", k5, make) == "over k5" and len(made) == 3
    assert descriptor(memo, "other", k5, make) == "over k5" and len(made) == 4  # kinds apart
