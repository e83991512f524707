"""The math of one bucket: PBG's scoring, losses, negatives and optimizers in PyTorch (on
the CPU: random-row gathers, RowAdagrad steps and the softmax loss in C, rows.py and
losses.py, the dot comparator's scores with the softmax loss chunk by chunk in one C call;
batched products through numpy's BLAS, blas.py).

kernel.py        the CPU kernel: one pass of training or evaluation over a bucket's edge
                 chunk (`train_bucket`, `evaluate_bucket`)
device_step.py   the device step: a bucket trained on a GPU (or the CPU) with the host out
                 of the batch loop (`BucketTrainer`, `train_bucket_on_device`)
dispatch.py      a count of the aten operations and host reads of torch code (tests, benchmarks)
embedder.py      scores, loss and gradients of one batch (the CPU kernel)
operators.py     relation operators; comparators.py  comparators; losses.py  losses
negatives.py     negative sampling; regularizers.py  N3
optim.py         Adagrad and RowAdagrad updates; rows.py  random-row access (C loops)
blas.py          batched products through numpy's BLAS, and its sgemm for the C step
params.py        shared parameters, partition keys and initialisation, PBG checkpoint layout
registry.py      components picked by name
native.py        the kernel process's environment and the C extensions' switch (no torch)

Never imports Ray. params.py and operators.py's layout load without torch (the partition
stores and the parameter server hold numpy arrays and never import it); the rest is torch.
This file imports nothing, so importing one module loads only what that module needs.
"""
