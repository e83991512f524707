"""Entity count and name files (PBG's entity_count_*.txt, entity_names_*.json): round
trips, counts of a config, and bad or missing files named in the error."""

import pytest

from pbg_ray.errors import PbgRayError
from pbg_ray.io.entities import (
    entity_count_file, load_dynamic_rel_count, load_entity_count, load_entity_counts,
    load_entity_names, load_relation_names, num_relation_ids, save_dynamic_rel_count,
    save_entity_count, save_entity_names, save_relation_names)


def test_round_trips(tmp_path):
    save_entity_count(tmp_path, "user", 3, 17)
    save_entity_names(tmp_path, "user", 3, ["a", "b\tc", "ü"])
    save_dynamic_rel_count(tmp_path, 5)
    save_relation_names(tmp_path, ["r0", "r1"])
    assert (tmp_path / "entity_count_user_3.txt").read_text() == "17\n"
    assert load_entity_count(tmp_path, "user", 3) == 17
    assert load_entity_names(tmp_path, "user", 3) == ["a", "b\tc", "ü"]
    assert load_dynamic_rel_count(tmp_path) == 5
    assert load_relation_names(tmp_path) == ["r0", "r1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "dynamic_rel_count.txt", "dynamic_rel_names.json",
        "entity_count_user_3.txt", "entity_names_user_3.json"]


def test_counts_of_a_config(make_config):
    config = make_config()
    for entity, econf in config.entities.items():
        for part in range(econf.num_partitions):
            save_entity_count(config.entity_path, entity, part, 10 * part + len(entity))
    assert load_entity_counts(config) == {"user": [4, 14], "item": [4, 14], "tag": [3]}
    assert num_relation_ids(config) == 3


@pytest.mark.parametrize("content, message", [
    ("abc\n", "must hold one integer, found 'abc'"),
    ("1.5", "must hold one integer"),
    ("-3\n", "negative count"),
    ("", "must hold one integer"),
])
def test_bad_count_file(tmp_path, content, message):
    entity_count_file(tmp_path, "user", 0).write_text(content)
    with pytest.raises(PbgRayError, match=message) as info:
        load_entity_count(tmp_path, "user", 0)
    assert "entity_count_user_0.txt" in str(info.value)


def test_missing_files_name_the_file(tmp_path):
    with pytest.raises(PbgRayError, match="entity_count_user_1.txt' is missing"):
        load_entity_count(tmp_path, "user", 1)
    with pytest.raises(PbgRayError, match="dynamic_rel_count.txt' is missing"):
        load_dynamic_rel_count(tmp_path)
    (tmp_path / "entity_names_user_0.json").write_text("{not json")
    with pytest.raises(PbgRayError, match="not valid JSON"):
        load_entity_names(tmp_path, "user", 0)
    (tmp_path / "entity_names_user_0.json").write_text('{"a": 1}')
    with pytest.raises(PbgRayError, match="JSON list"):
        load_entity_names(tmp_path, "user", 0)
