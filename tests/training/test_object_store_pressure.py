"""Memory placement with an object store smaller than the table: Ray spills partitions to
disk (or maps them from its fallback files) and the run finishes with a complete
checkpoint; it neither hangs nor stops. Runs in a subprocess, which starts its own Ray with
a small object store (the session's shared Ray has a large one)."""

import json
import subprocess
import sys
import textwrap

import pytest

from pbg_ray.config import ConfigSchema
from tests.util import assert_valid_checkpoint, config_dict, write_random_graph

STORE_BYTES = 80 * 1024 ** 2  # near Ray's smallest object store

TRAIN = textwrap.dedent("""
    import json, sys
    import ray
    from ray._private.internal_api import memory_summary
    from pbg_ray.config import ConfigSchema
    from pbg_ray.training.trainer import Trainer

    config = ConfigSchema.from_dict(json.loads(sys.argv[1]))
    ray.init(address="local", num_cpus=2, object_store_memory=int(sys.argv[2]),
             include_dashboard=False, logging_level="ERROR")
    result = Trainer(config).run()
    print(memory_summary(ray.get_runtime_context().gcs_address, stats_only=True))
    print(json.dumps({"version": result.version}))
    ray.shutdown()
""")


@pytest.mark.slow
@pytest.mark.parametrize("num_partitions, rows_per_type", [(2, 160_000), (1, 240_000)])
def test_a_table_larger_than_the_object_store_spills_and_finishes(tmp_path, num_partitions,
                                                                  rows_per_type):
    # Embeddings and Adagrad sums of 4 partitions, each smaller than the object store and
    # half as large again as it in all; or of 2, each partition alone larger than the store.
    rows = rows_per_type // num_partitions
    data = config_dict(tmp_path, dimension=100, num_epochs=1, entities={
        "user": {"num_partitions": num_partitions}, "item": {"num_partitions": num_partitions},
        "tag": {"num_partitions": 1}})
    config = ConfigSchema.from_dict(data)
    write_random_graph(config, num_edges=500, counts={"user": rows, "item": rows, "tag": 7})
    table_bytes = 2 * rows_per_type * (100 + 1) * 4
    assert table_bytes > 1.5 * STORE_BYTES
    assert num_partitions > 1 or table_bytes / 2 > STORE_BYTES

    proc = subprocess.run([sys.executable, "-c", TRAIN, json.dumps(data), str(STORE_BYTES)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {"version": 1}
    # Ray reports what did not fit: spilled objects or its filesystem fallback.
    assert "Spilled" in proc.stdout or "filesystem mmap usage" in proc.stdout, proc.stdout
    assert_valid_checkpoint(config, 1)
