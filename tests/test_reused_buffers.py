"""rpcx._util.memory.ReusedBuffers: a buffer is handed out again only once nothing
holds it, within a limit of kept bytes."""

from __future__ import annotations

import threading

import pytest
import torch

from rpcx._util import memory
from rpcx.transport_kit.buffers import owning_memory

MIB = 1 << 20

pytestmark = pytest.mark.skipif(memory._storage_use_count is None,
                                reason="this torch does not count a storage's users")


def test_a_buffer_comes_back_once_nothing_holds_it() -> None:
    buffers = memory.ReusedBuffers(limit=64 * MIB, smallest=MIB)
    first = buffers.take(5 * MIB)
    assert first.numel() == first.untyped_storage().nbytes() == 5 * MIB
    address = first.data_ptr()
    second = buffers.take(5 * MIB)  # (the first is held: another one)
    assert second.data_ptr() != address
    assert buffers.kept_bytes == 10 * MIB
    del first
    assert buffers.take(5 * MIB).data_ptr() == address  # (dropped at once: used again)
    assert buffers.kept_bytes == 10 * MIB


@pytest.mark.parametrize("holder", ["slice", "reshaped", "library", "storage"])
def test_whoever_keeps_a_view_keeps_the_buffer_from_reuse(holder: str) -> None:
    # A transport may hold the memory past send in its own way (a slice, a view of
    # another dtype, a buffer handed to a library: ZeroMQ's zero-copy sends).
    buffers = memory.ReusedBuffers(limit=64 * MIB, smallest=MIB)
    taken = buffers.take(2 * MIB)
    taken.fill_(7)
    held = {"slice": lambda t: t[MIB:], "reshaped": lambda t: t.view(torch.int32),
            "library": owning_memory, "storage": lambda t: t.untyped_storage()}[holder](taken)
    address = taken.data_ptr()
    del taken
    again = buffers.take(2 * MIB)
    assert again.data_ptr() != address
    again.fill_(1)
    if holder == "storage":
        seen = memory.memory_at(held.data_ptr(), held.nbytes())
    else:
        seen = memoryview(held).cast("B") if holder == "library" else memory.memory_of(held)
    assert set(bytes(seen)) == {7}  # (untouched by the new holder)
    del seen
    kept = {k.buffer.data_ptr() for k in buffers._kept}
    assert kept == {address, again.data_ptr()}
    del held, again
    assert buffers.take(2 * MIB).data_ptr() in kept  # (both idle now: no third one)
    assert buffers.kept_bytes == 4 * MIB


def test_at_most_the_limit_is_kept_oldest_idle_first() -> None:
    buffers = memory.ReusedBuffers(limit=10 * MIB, smallest=MIB)
    held = [buffers.take(4 * MIB), buffers.take(4 * MIB)]
    assert buffers.kept_bytes == 8 * MIB
    beyond = buffers.take(4 * MIB)  # (both kept ones are held: a fresh one, not kept)
    assert buffers.kept_bytes == 8 * MIB
    assert beyond.data_ptr() not in {b.data_ptr() for b in held}
    del held[0]  # the older one is idle now: it makes room for another size
    other = buffers.take(3 * MIB)
    assert buffers.kept_bytes == 7 * MIB
    assert [k.buffer.numel() for k in buffers._kept] == [4 * MIB, 3 * MIB]
    del other
    buffers.clear()
    assert buffers.kept_bytes == 0


def test_small_and_huge_buffers_are_fresh_each_time() -> None:
    buffers = memory.ReusedBuffers(limit=8 * MIB, smallest=MIB)
    for size in (MIB - 1, 9 * MIB):
        taken = buffers.take(size)
        assert taken.numel() == taken.untyped_storage().nbytes() == size
    assert buffers.kept_bytes == 0


def test_threads_taking_at_once_never_share_a_buffer() -> None:
    # Each thread fills what it took with its own number and reads it back after the
    # others had their turn: a buffer handed to two holders at once would show another.
    buffers = memory.ReusedBuffers(limit=64 * MIB, smallest=MIB)
    rounds, threads = 30, 4
    turn = threading.Barrier(threads, timeout=30)
    mixed: list[tuple[int, int]] = []

    def take_and_check(number: int) -> None:
        for _ in range(rounds):
            taken = buffers.take(MIB)
            taken.fill_(number)
            turn.wait()  # (every thread holds one now)
            if not bool((taken == number).all()):
                mixed.append((number, int(taken[0])))
            del taken
            turn.wait()  # (every thread dropped its one)

    workers = [threading.Thread(target=take_and_check, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert not any(worker.is_alive() for worker in workers)
    assert not mixed
    assert buffers.kept_bytes == threads * MIB
    assert buffers.reused == threads * (rounds - 1)
