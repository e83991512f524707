"""Ray plumbing the domains share: connecting to Ray, task results, fault points and
per-partition jobs as Ray tasks."""
