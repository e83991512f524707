"""Training: the trainer and its pass loop, the bucket scheduler and its actor, the actors
that hold the model, the bucket task and its partition buffer, TensorBoard and the stats."""
