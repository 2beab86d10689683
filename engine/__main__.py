"""`python -m engine --model PATH [vLLM-style flags]`: the OpenAI-compatible engine server."""
from engine.server import main

if __name__ == "__main__":
    main()
