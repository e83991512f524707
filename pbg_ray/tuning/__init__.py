"""Ray Tune over training: one trial a training run of a sampled config."""
