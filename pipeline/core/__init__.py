"""The bottom layer: errors, batches as trees, collation, stage kinds, the transform registry, step records."""
