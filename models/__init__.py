"""Model families written once (Flax NNX, logical axis names); configs with analytic counts; precision policies."""
