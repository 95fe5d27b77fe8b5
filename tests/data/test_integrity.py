"""What the cache gives back is what was stored by this user under that name, or nothing: every
damaged, cut, moved or planted entry is rejected and the sample loaded instead, nothing stored is
ever unpickled, and what cannot be stored safely is left uncached with the reason."""

import collections
import os
import pickle

import numpy as np
import pytest
import torch

from autopatch.data import CacheLoader, CachedDataset, LocalStore, RedisStore
from autopatch.data.store.entry_seal import DAMAGED, STALE, Seal
from autopatch.data.store.sample_codec import Undecodable, Unstorable, decode, encode
from data_fixtures import Features, redis_server  # noqa: F401,F811 (a fixture)


class Planted:
    """A pickle that creates a file when unpickled: what an attacker would store."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_every_flipped_byte_and_every_cut_of_an_entry_is_rejected(tmp_path):
    dataset = Features(4)
    cached = CachedDataset(dataset, dataset_name="flips", path=tmp_path / "cache", writer_buffer_size=1)
    expected = dataset[2]
    cached[2]   # stored
    store, name = cached.cache_loader.store, cached.cache_loader.key(2)
    entry = store.get(name)
    assert entry is not None
    damaged = [entry[:i] + bytes([entry[i] ^ bit]) + entry[i + 1:] for i in range(len(entry)) for bit in (1, 128)]
    damaged += [entry[:i] for i in range(len(entry))] + [entry + b"\0"]
    for bad in damaged:
        store.set(name, bad)
        x, y = cached[2]   # never an exception, never a different sample
        assert torch.equal(x, expected[0]) and y == expected[1]
    figures = cached.describe()
    assert (figures["rejected"], figures["misses"], figures["hits"]) == (len(damaged), len(damaged) + 1, 0), figures
    assert "failed its integrity check" in figures["last_error"]


@pytest.mark.parametrize("kind", ["local", "redis"])
def test_a_planted_pickle_is_never_run(kind, tmp_path, redis_server):  # noqa: F811
    options = {"path": tmp_path / "cache"} if kind == "local" else {"backend": "redis", "hosts": [redis_server.url]}
    dataset = Features(4)
    cached = CachedDataset(dataset, dataset_name="planted", writer_buffer_size=1, **options)
    marker = tmp_path / "ran"
    loader = cached.cache_loader
    stamp = loader.stamp_here()
    key = Seal(b"a key that is not the user's" + bytes(4))
    for index, payload in enumerate([pickle.dumps(Planted(marker)), encode(pickle.dumps(Planted(marker)))]):
        name = loader.key(index)
        loader.store.set(name, key.close(name.encode(), stamp, payload))   # sealed with another key
        assert torch.equal(cached[index][0], dataset[index][0])
    # sealed with the user's own key, but a pickle: the codec does not unpickle
    name = loader.key(3)
    loader.store.set(name, loader.seal.close(name.encode(), stamp, pickle.dumps(Planted(marker))))
    assert torch.equal(cached[3][0], dataset[3][0])
    assert not marker.exists()
    assert cached.describe()["rejected"] == 2 and cached.describe()["errors"] == 3


def test_an_entry_moved_to_another_index_or_left_by_another_version():
    seal = Seal(os.urandom(32))
    entry = seal.close(b"d_1", b"v1", b"payload")
    assert bytes(seal.open(b"d_1", b"v1", entry)) == b"payload"
    assert seal.open(b"d_2", b"v1", entry) is DAMAGED     # moved to another key
    assert seal.open(b"d_1", b"v2", entry) is STALE       # another version of the dataset: a plain miss
    assert Seal(os.urandom(32)).open(b"d_1", b"v1", entry) is DAMAGED


def test_codec_gives_back_exact_tensors_and_the_same_bytes():
    base = torch.arange(100.0).reshape(10, 10)
    samples = [base[3], base[:, 2], base.t(), torch.empty(0, 3), torch.tensor(5),
               torch.ones(3, dtype=torch.bfloat16), torch.tensor([True, False]),
               torch.randn(3, requires_grad=True), torch.randn(2, dtype=torch.complex64),
               torch.tensor([float("nan"), -0.0])]
    for t in samples:
        back = decode(encode({"x": t, "y": [1, "a"]}))["x"]
        assert (back.dtype, back.shape, back.stride(), back.requires_grad) == \
            (t.dtype, t.shape, t.stride(), t.requires_grad)
        assert encode(back) == encode(t) and back.detach().contiguous().view(-1).view(torch.uint8).tolist() \
            == t.detach().contiguous().view(-1).view(torch.uint8).tolist()
    assert len(encode(base[3])) < 400   # a row, not the whole 400-byte-plus storage
    assert encode((torch.arange(5.0), np.arange(3))) == encode((torch.arange(5.0), np.arange(3)))
    plain = {"ids": [1, 2**70, -3], "f": 0.1, "c": 1j, "s": "é", "b": b"\0", "ba": bytearray(b"x"), "n": None,
             "t": (True, False), "a": np.arange(6.0).reshape(2, 3).T, "g": np.int64(7), "h": np.float16(1.5),
             "u": np.array(["ab", "c"]), 3: "int key"}
    back = decode(encode(plain))
    assert encode(back) == encode(plain) and type(back["g"]) is np.int64 and back["a"].flags.f_contiguous
    assert all(type(back[k]) is type(v) for k, v in plain.items() if k not in ("a", "u"))


@pytest.mark.parametrize("sample", [lambda: 0, collections.namedtuple("P", "x")(1), np.array([object()]),
                                    torch.randn(2, requires_grad=True) * 2, Planted("x"), {1, 2}])
def test_what_cannot_come_back_exactly_and_safely_is_not_stored(sample):
    with pytest.raises(Unstorable):
        encode(sample)


def test_decoding_damaged_bytes_raises_one_error_and_allocates_nothing_it_is_told():
    data = encode({"x": torch.arange(64.0), "y": [np.arange(4), "text", 2**80]})
    for i in range(len(data)):
        for bad in (data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:], data[:i]):
            try:
                decode(bad)
            except Undecodable:
                pass
    with pytest.raises(Undecodable):
        decode(b"l" + (2**32 - 1).to_bytes(4, "little"))    # four billion items claimed in 5 bytes
    with pytest.raises(Undecodable):
        decode(b"b" + (2**63).to_bytes(8, "little"))        # an 8 EiB blob claimed


def test_unstorable_samples_leave_the_dataset_uncached_with_the_reason(tmp_path):
    from autopatch.data.probe.cacheability import probe

    class Points(Features):
        def __getitem__(self, i):
            return collections.OrderedDict(x=super().__getitem__(i)[0])

    verdict = probe(Points(8))
    assert not verdict.cacheable and "collections.OrderedDict" in verdict.reason


def test_loader_and_store_for_bagua_code_still_work(tmp_path, redis_server):  # noqa: F811
    for loader in (CacheLoader("local", "plain", path=tmp_path / "cache"),
                   CacheLoader("redis", "plain", hosts=[redis_server.url])):
        assert [loader.get(k, lambda k: {"v": k}) for k in range(3)] == [{"v": k} for k in range(3)]
        assert loader.peek([0, 1, 2, 3]) == [{"v": 0}, {"v": 1}, {"v": 2}, None]
    assert isinstance(LocalStore(path=tmp_path / "cache"), LocalStore) and RedisStore(hosts=[redis_server.url])
