"""Model-card templates (Markdown), installed as ``hf_kvcodecs.model_cards`` package data and filled by
``hf_kvcodecs.quantization.hub`` (compressed models) and ``hf_kvcodecs.gsrq.hub`` (codebooks)."""
