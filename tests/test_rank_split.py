"""The data stage split by rank (`eagle3_zoo.data.ranks`): regeneration and the feature job run by two processes
(each its share, waiting for the other through the files) write exactly what one process writes."""

from __future__ import annotations

import multiprocessing as mp

from training_fixtures import regenerate_share, write_feature_share


def _run_ranks(fn, world_size, *args):
    with mp.get_context("fork").Pool(world_size) as pool:  # one rank per worker: each waits for the other's parts
        return pool.starmap(fn, [(r, world_size, *args) for r in range(world_size)], chunksize=1)


def _files(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and not p.name.endswith(".lock")}


def test_rank_split_regeneration_equals_one_process(tmp_path):
    one, two = tmp_path / "one" / "answers.jsonl", tmp_path / "two" / "answers.jsonl"
    assert regenerate_share(0, 1, str(one)) == 5
    generated = _run_ranks(regenerate_share, 2, str(two))
    assert generated == [3, 2]  # batches of 2, 2, 1 in prompt-length order: rank 0 takes the first and last
    assert two.read_bytes() == one.read_bytes()
    assert _files(two.parent) == _files(one.parent)  # the part files are merged and gone
    assert not list(two.parent.glob("*.part-[0-9]*[0-9]"))
    # a rerun with another world size finds everything done
    assert _run_ranks(regenerate_share, 2, str(one)) == [0, 0]
    assert two.read_bytes() == one.read_bytes()


def test_rank_split_feature_job_equals_one_process(tmp_path):
    from eagle3_zoo.data.features import FeatureReader

    write_feature_share(0, 1, str(tmp_path / "one"))
    _run_ranks(write_feature_share, 2, str(tmp_path / "two"))
    one, two = _files(tmp_path / "one"), _files(tmp_path / "two")
    assert sorted(one) == sorted(two) and "manifest.json" in one and "part-00005/manifest.json" in one
    assert one == two  # shards, part manifests and the merged manifest, byte for byte
    a, b = FeatureReader(tmp_path / "one", verify="hash"), FeatureReader(tmp_path / "two", verify="hash")
    assert a.sample_ids == b.sample_ids and len(a) == 11
