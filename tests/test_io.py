"""The one directory-replacement helper (drafter folders, sharded checkpoints): never a half-written target, and a
replacement cut short between its two renames is undone."""

import os

from eagle3_zoo.util.fileio import recover_replaced_directory, replace_directory


def _tree(root, **files):
    root.mkdir()
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def test_replace_directory_swaps_whole_trees_and_files(tmp_path):
    path = _tree(tmp_path / "drafter", a="old", stale="x")
    replace_directory(_tree(tmp_path / "staged", a="new"), path)
    assert sorted(os.listdir(path)) == ["a"] and (path / "a").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["drafter"]  # nothing staged or moved aside is left
    single = tmp_path / "last.ckpt"
    single.write_text("a single-file checkpoint")
    replace_directory(_tree(tmp_path / "sharded", meta="m"), single)
    assert (single / "meta").read_text() == "m"


def test_a_replacement_cut_short_is_recovered(tmp_path):
    path = _tree(tmp_path / "last.ckpt", meta="old")
    os.rename(path, tmp_path / ".last.ckpt.old")  # the crash came after the first rename, before the second
    recover_replaced_directory(path)
    assert (path / "meta").read_text() == "old"
    recover_replaced_directory(path)  # nothing to do now
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]
