"""Bad input is refused with the project's error, naming the file, key or value: a
corpus of bad files (tests/bad_inputs/), and good edge and checkpoint files damaged
byte by byte, from which nothing but a PbgRayError may escape the readers."""

import contextlib
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pbg_ray.checkpoints.directory import CheckpointStorage
from pbg_ray.errors import PbgRayError
from pbg_ray.io.edges import edges_file
from pbg_ray.types import Bucket
from tests.bad_input import (
    CORPUS, DAMAGE, damage, good_graph, load_cases, read_checkpoint, read_edges_as_training,
    refusal)

CASES = load_cases()


def test_the_corpus_has_every_kind_of_input_and_no_file_unused():
    kinds = Counter(case["file"].split("/")[0] for case in CASES)
    assert len(CASES) >= 25
    assert set(kinds) == {"configs", "entities", "edges", "checkpoints", "raw"}
    files = {str(p.relative_to(CORPUS)) for p in CORPUS.glob("*/*")}
    assert files == {case["file"] for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=[case["file"] for case in CASES])
def test_bad_input_is_refused_naming_the_file_and_what_is_wrong(case, tmp_path):
    refusal(case, tmp_path)


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    return good_graph(tmp_path_factory.mktemp("graph"))


@contextlib.contextmanager
def damaged(path: Path, how: str, where: float, junk: bytes):
    """`path` holds damaged bytes inside the block, its own again afterwards."""
    good = path.read_bytes()
    path.write_bytes(damage(good, how, where, junk))
    try:
        yield
    finally:
        path.write_bytes(good)


DAMAGES = dict(how=st.sampled_from(DAMAGE), where=st.floats(0, 1),
               junk=st.binary(min_size=1, max_size=64))


@settings(max_examples=150, deadline=None)
@given(bucket=st.sampled_from([Bucket(0, 0), Bucket(0, 1), Bucket(1, 1)]), **DAMAGES)
# A dataset's type turned into HDF5's time type, which numpy has no equivalent of.
@example(bucket=Bucket(0, 0), how="xor", where=0.13781079285699474, junk=b"\x00\x02")
def test_damaged_edge_files_give_only_the_projects_error(graph, bucket, how, where, junk):
    with damaged(edges_file(graph.edge_paths[0], bucket), how, where, junk):
        with contextlib.suppress(PbgRayError):
            read_edges_as_training(graph)


CHECKPOINT_FILES = ["checkpoint_version.txt", "config.json", "model.v1.h5",
                    "embeddings_user_0.v1.h5", "embeddings_item_1.v1.h5", "embeddings_tag_0.v1.h5"]


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(CHECKPOINT_FILES), **DAMAGES)
def test_damaged_checkpoint_files_give_only_the_projects_error(graph, name, how, where, junk):
    with damaged(CheckpointStorage(graph.checkpoint_path).path / name, how, where, junk):
        with contextlib.suppress(PbgRayError):
            read_checkpoint(graph)
