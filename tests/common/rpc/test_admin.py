"""The profiler's output directory stays under --profile-dir, whatever `..` or symlinks the caller tries."""

from __future__ import annotations

import os

import pytest

from tandem.common.rpc.admin import profile_output_dir


def test_paths_under_the_root_are_allowed(tmp_path):
    root = os.path.realpath(tmp_path)
    assert profile_output_dir(str(tmp_path), None) == root
    assert profile_output_dir(str(tmp_path), "run") == os.path.join(root, "run")
    assert profile_output_dir(str(tmp_path), os.path.join(root, "a", "..", "b")) == os.path.join(root, "b")


@pytest.mark.parametrize("escape", ["/etc", "..", "../x", "link", "link/deeper"])
def test_escapes_are_refused_naming_the_root(tmp_path, escape):
    root = tmp_path / "profiles"
    root.mkdir()
    (root / "link").symlink_to(tmp_path)  # points outside the root
    with pytest.raises(ValueError, match=f"outside the profile directory {os.path.realpath(root)}"):
        profile_output_dir(str(root), escape)
