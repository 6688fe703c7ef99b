"""mstar: serving runtime for composite multimodal models (Walk Graph)."""
