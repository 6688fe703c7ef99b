"""Model families shipped with mstar. Each registers its names here; nothing heavy is imported."""

from mstar.model.registry import register_model

# Unified multimodal: BAGEL (text/image in, text/image out), and its tiny offline variant.
register_model("bagel", "mstar.models.bagel.model:BagelModel")
register_model("bagel-tiny", "mstar.models.bagel.model:BagelTiny")

# Structure-only declarations (graph + next_walk, no weights yet): drawable with `mstar graph`.
register_model("qwen3-omni", "mstar.models.qwen3_omni.graph:Qwen3OmniGraph")

# Text-to-speech: Orpheus (Llama + SNAC), and its tiny offline variant.
register_model("orpheus", "mstar.models.orpheus.model:OrpheusTTS")
register_model("orpheus-tiny", "mstar.models.orpheus.model:OrpheusTiny")

# Text generation: a Hugging Face Llama checkpoint, and a tiny one with dummy weights (offline).
register_model("llama", "mstar.models.llama.graph:LlamaLM")
register_model("llama-tiny", "mstar.models.llama.graph:LlamaTiny")

# World model: V-JEPA 2-AC (encoder + action-conditioned predictor), and its tiny offline variant.
register_model("vjepa2-ac", "mstar.models.vjepa2.model:VJepa2AC")
register_model("vjepa2-ac-tiny", "mstar.models.vjepa2.model:VJepa2ACTiny")
