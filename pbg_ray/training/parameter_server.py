"""The actor that holds the shared, non-entity parameters (relation operators, global
embeddings): train tasks pull a copy and push the change they made.

It only holds state, so it asks for no CPU (`num_cpus=0`) and never keeps a train task
from being placed.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import ray

from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.config import ConfigSchema
from pbg_ray.model.params import ModelParams, init_params, params_to_checkpoint
from pbg_ray.runtime.faults import fault_point
from pbg_ray.training.bucket_sources import ModelSource


@ray.remote(num_cpus=0)
class ParameterServer:
    """The shared, non-entity parameters (relation operators, global embeddings)
    with their Adagrad sums. Concurrent train tasks pull a copy and push the
    change they made, which is added here."""

    def __init__(self, config: ConfigSchema, num_relation_ids: int) -> None:
        self.config = config
        self.num_relation_ids = num_relation_ids
        self.params: Optional[ModelParams] = None

    def load(self, source: Optional[ModelSource]) -> None:
        """The first values: PBG's initial ones (source None) or those of a model file. (A
        method, not the constructor, so that a bad file's error reaches the driver as this
        call's, like PartitionStore.add's.)"""
        self.params = (init_params(self.config, self.num_relation_ids) if source is None
                       else source.load(self.config, self.num_relation_ids))

    def get(self) -> ModelParams:
        return self.params

    def apply_delta(self, delta: ModelParams) -> None:
        fault_point("parameter_server.update")
        for name, value in delta.arrays.items():
            self.params.arrays[name] += value
        for name, value in delta.sums.items():
            self.params.sums[name] += value

    def save(self, version: int, metadata: Dict[str, Any]) -> None:
        arrays, optim_state = params_to_checkpoint(self.config, self.params)
        CheckpointManager(self.config.checkpoint_path).write_model(version, arrays, optim_state,
                                                                   metadata)
