"""NixlFileStorage moves HiCache L3 pages through NIXL's real POSIX plugin."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem.common.flags import ConfigError
from tandem.common.memory import hicache_nixl
from tandem.common.memory.hicache_nixl import NixlFileStorage


@pytest.fixture
def storage(tmp_path):
    s = NixlFileStorage(str(tmp_path / "l3"))
    yield s
    s.close()


def test_put_get_round_trips_pages_of_any_size(storage):
    pages = {"a1": os.urandom(4096), "b2": os.urandom(100_000), "c3": b"x", "d4": b""}
    for key, payload in pages.items():
        storage.put(key, payload)
    for key, payload in pages.items():
        assert storage.contains(key)
        assert storage.get(key) == payload
    assert storage.bytes_used() == sum(len(p) for p in pages.values())
    assert storage.get("ff") is None and not storage.contains("ff")


def test_put_replaces_a_page_whole_and_leaves_no_temporary_files(storage):
    storage.put("ab", b"1" * 5000)
    storage.put("ab", b"2" * 300)
    assert storage.get("ab") == b"2" * 300
    assert os.listdir(storage.directory) == ["ab.kvpage"]


def test_keys_by_age_is_lru_order_and_delete_and_clear_free_bytes(storage):
    for key in ("aa", "bb", "cc"):
        storage.put(key, key.encode() * 10)
    assert storage.keys_by_age() == ["aa", "bb", "cc"]
    storage.get("aa")  # an access makes it the newest
    assert storage.keys_by_age() == ["bb", "cc", "aa"]
    storage.delete("cc")
    storage.delete("cc")  # deleting an absent page is no error
    assert storage.keys_by_age() == ["bb", "aa"] and storage.bytes_used() == 40
    storage.clear()
    assert storage.keys_by_age() == [] and storage.bytes_used() == 0


def test_two_agents_on_one_directory_see_each_others_pages(tmp_path):
    first, second = NixlFileStorage(str(tmp_path)), NixlFileStorage(str(tmp_path))
    try:
        assert first.agent_name != second.agent_name
        first.put("0123", b"from the first" * 100)
        assert second.contains("0123") and second.get("0123") == b"from the first" * 100
        second.put("4567", b"from the second")
        assert first.get("4567") == b"from the second"
        assert first.keys_by_age() == second.keys_by_age() == ["0123", "4567"]
        second.delete("0123")
        assert first.get("0123") is None
    finally:
        first.close()
        second.close()


@pytest.mark.e2e
def test_a_page_written_by_another_process_reads_back(tmp_path):
    payload = bytes(range(256)) * 64
    script = ("import sys; from tandem.common.memory.hicache_nixl import NixlFileStorage; "
              "s = NixlFileStorage(sys.argv[1]); s.put('beef', bytes(range(256)) * 64); s.close()")
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, timeout=120, env=os.environ.copy())
    reader = NixlFileStorage(str(tmp_path))
    try:
        assert reader.get("beef") == payload
    finally:
        reader.close()


def test_keys_must_be_hex_so_a_key_cannot_name_another_path(storage):
    with pytest.raises(ValueError, match="hex"):
        storage.put("../etc", b"x")


def test_a_nixl_without_the_posix_plugin_is_a_config_error_naming_the_flag(tmp_path, monkeypatch):
    monkeypatch.setattr(hicache_nixl, "FILE_PLUGIN", "NO_SUCH_PLUGIN")
    with pytest.raises(ConfigError, match="--hicache-storage-backend nixl.*NO_SUCH_PLUGIN"):
        NixlFileStorage(str(tmp_path))
