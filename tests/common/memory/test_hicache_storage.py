"""L3: the file backend (atomic pages, LRU order, pages found after a restart), the page codec and keys."""

import pytest
import torch

from tandem.common.memory.hicache_page import PageFormatError, PageLayout, decode_page, encode_page, model_identity, \
    storage_key
from tandem.common.memory.hicache_storage import FileStorage, make_storage_backend

LAYOUT = PageLayout(2, 4, 1, 2, torch.bfloat16)


def rows(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 255, (4, 1, 4), dtype=torch.uint8, generator=g) for _ in range(4)]


def test_file_backend_put_get_lru_and_restart(tmp_path):
    store = FileStorage(str(tmp_path))
    store.put("aa", b"one")
    store.put("bb", b"three")
    assert store.get("aa") == b"one" and store.get("cc") is None
    assert store.keys_by_age() == ["bb", "aa"]  # aa was read last
    assert store.bytes_used() == 8 and store.contains("bb")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    restarted = FileStorage(str(tmp_path))
    assert sorted(restarted.keys_by_age()) == ["aa", "bb"] and restarted.bytes_used() == 8
    other = FileStorage(str(tmp_path))
    store.put("cc", b"x")
    assert other.contains("cc") and other.get("cc") == b"x"  # written by another process since its start
    store.delete("aa")
    assert not store.contains("aa")
    store.clear()
    assert store.bytes_used() == 0 and not any(tmp_path.iterdir())
    with pytest.raises(ValueError):
        store.put("../x", b"")


def test_make_storage_backend(tmp_path):
    assert make_storage_backend("file", str(tmp_path), 10).name == "file"
    with pytest.raises(ValueError):
        make_storage_backend("tape", str(tmp_path), 10)


def test_page_codec_round_trips_and_refuses_what_does_not_fit():
    page = encode_page(LAYOUT, rows(1))
    assert all(torch.equal(a, b.view(4, 1, 4)) for a, b in zip(decode_page(LAYOUT, page), rows(1)))
    flipped = bytearray(page)
    flipped[-3] ^= 1
    with pytest.raises(PageFormatError, match="checksum"):
        decode_page(LAYOUT, bytes(flipped))
    with pytest.raises(PageFormatError):
        decode_page(PageLayout(2, 4, 1, 2, torch.float16), page)  # another dtype
    with pytest.raises(PageFormatError):
        decode_page(LAYOUT, page[:-1])
    with pytest.raises(PageFormatError, match="magic"):
        decode_page(LAYOUT, b"XXXX" + page[4:])


def test_keys_fold_in_model_weights_and_layout(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    base = model_identity(str(tmp_path), LAYOUT, "v1")
    assert model_identity(str(tmp_path), LAYOUT, "v2") != base
    assert model_identity(str(tmp_path), PageLayout(2, 8, 1, 2, torch.bfloat16), "v1") != base
    assert storage_key(base, 5) != storage_key(base, 6)
    assert storage_key(base, 5) == storage_key(model_identity(str(tmp_path), LAYOUT, "v1"), 5)
