"""Peer systems of the comparison benchmarks: scripts that their own virtualenvs run (mstar itself imports none of them; its tests check ``vllm_audio_codes.keep_audio_codes``)."""
