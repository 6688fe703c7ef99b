"""Llama (HF ``LlamaForCausalLM`` checkpoints) as a prefill/decode Walk Graph; ``llama-tiny`` runs offline."""
