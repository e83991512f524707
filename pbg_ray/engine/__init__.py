"""The engine: training, evaluation, Tune and serving on Ray (the only Ray code besides the commands).

trainer.py      the training driver: epochs, passes and buckets; versions through the
                checkpoint manager
scheduler.py    bucket orders and partition locks, and the scheduler actor (light: no model code)
actors.py       partition stores, the parameter server
bucket_task.py  one bucket's training as a Ray task around the model's kernel
partitions.py   where a partition's values come from, and in disk placement where they go
evaluator.py    sampled and filtered evaluation spread over buckets as Ray tasks
tuner.py        Ray Tune: one trial is one training run of a sampled config
serving.py      the HTTP service on Ray Serve: router, shard deployments, index build tasks
cluster.py      connecting the driver to Ray
faults.py       named fault points for the fault-injection tests and fault_bench
tensorboard.py  TensorBoard scalars of a run
"""
