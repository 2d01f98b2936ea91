"""The broadcast group: rank 0 hosts its rendezvous on a store it has already bound, so no other process can take
the port between choosing and binding it; a receiver in another process joins as a client and gets the bytes."""

import socket
import subprocess
import sys

import pytest
import torch

from miles_ray.sync.broadcast import BroadcastGroup, open_store

RECEIVE = (  # the group closed before exit: one freed during interpreter shutdown aborted it (SIGABRT) 3 times in 60
    "import sys, torch\n"
    "from miles_ray.sync.broadcast import BroadcastGroup\n"
    "g = BroadcastGroup.create('127.0.0.1', int(sys.argv[1]), 1, 2, 'gloo', timeout_s=60)\n"
    "t = torch.zeros(5, dtype=torch.uint8); g.broadcast(t); print(t.tolist())\n"
    "g.close()\n"
)


def test_the_store_holds_its_port_from_the_start():
    store = open_store("127.0.0.1", 2, timeout_s=10)
    with socket.socket() as s, pytest.raises(OSError):  # what another process's bind of that port now gets
        s.bind(("127.0.0.1", store.port))


@pytest.mark.timeout(120)
def test_a_receiver_in_another_process_joins_rank_0_s_store_and_gets_the_bytes():
    store = open_store("127.0.0.1", 2, timeout_s=60)
    receiver = subprocess.Popen(
        [sys.executable, "-c", RECEIVE, str(store.port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    group = BroadcastGroup.create("127.0.0.1", store.port, 0, 2, "gloo", timeout_s=60, store=store)
    group.broadcast(torch.tensor([1, 2, 3, 250, 7], dtype=torch.uint8))
    out, err = receiver.communicate(timeout=60)
    group.close()
    assert receiver.returncode == 0, err
    assert out.strip() == "[1, 2, 3, 250, 7]"


@pytest.mark.timeout(60)
def test_close_leaves_torch_s_registry_and_a_re_formed_group_works():
    """What the trainer and engine actors do when a group is re-formed: the old group is freed then, not leaked."""
    from torch.distributed.distributed_c10d import _world

    store = open_store("127.0.0.1", 1, timeout_s=10)
    group = BroadcastGroup.create("127.0.0.1", store.port, 0, 1, "gloo", timeout_s=10, store=store)
    pg = group.pg
    assert pg in _world.pg_map and pg in _world.pg_group_ranks
    group.close()
    group.close()  # idempotent
    assert pg not in _world.pg_map and pg not in _world.pg_group_ranks
    assert sys.getrefcount(pg) == 2  # only `pg` here (and the call's argument): the group's threads end as it goes
    store = open_store("127.0.0.1", 1, timeout_s=10)
    again = BroadcastGroup.create("127.0.0.1", store.port, 0, 1, "gloo", timeout_s=10, store=store)
    assert again.broadcast(torch.arange(3)).tolist() == [0, 1, 2]
    again.close()
