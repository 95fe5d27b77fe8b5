"""What ranks tell each other through the job's store: an exchange hands back every part in the
order asked for, and one whose part never comes ends at its bound with an error that says what it
waited for, never hanging the program."""

import pytest
import torch.distributed as dist

from autopatch.job_store import StoreWaitError, exchange, first_answer


def test_an_exchange_hands_back_every_part_in_order():
    store = dist.HashStore()
    store.set("part/1", "b")
    assert exchange(store, ["part/0", "part/1"], 5, "both parts", mine=("part/0", "a")) == [b"a", b"b"]


def test_an_exchange_whose_part_never_comes_says_what_it_waited_for():
    store = dist.HashStore()
    with pytest.raises(StoreWaitError, match=r"waited .* for every node's address: .* most likely exited or stalled"):
        exchange(store, ["part/0", "part/1"], 0.2, "every node's address", mine=("part/0", "a"))


def test_a_single_process_keeps_its_own_answer():
    answer = first_answer("question", b"mine")
    assert (answer.value, answer.own, answer.shared) == (b"mine", True, True)
