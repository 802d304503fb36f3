"""`engine=hf`: HF transformers' own modeling code with our cache through the bridge (hybridcache.hf.cache_for), set up
once for every experiment that takes it (engine.py) and wrapped in the interface the study evaluates (model.py)."""
