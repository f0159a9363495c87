"""Process groups, collectives, and the tensor-/expert-parallel layers the model is built from."""
