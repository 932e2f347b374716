from .gsrq import GSRQCache, GSRQLayer, load_codebooks

__all__ = ["GSRQCache", "GSRQLayer", "load_codebooks"]
