"""V-JEPA 2-AC world model: ViT-g video encoder + action-conditioned predictor (full and KV-cached rollout)."""
