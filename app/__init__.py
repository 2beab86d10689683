"""The launcher: picks the model, starts the engine and then the proxy, supervises both, stops them cleanly.

Standard library and psutil only: it must start instantly and keep working when torch is broken or missing.
"""
