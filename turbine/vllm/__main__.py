import sys

from turbine.vllm.worker import main

# vLLM spawns processes that re-import the main module: keep the guard.
if __name__ == "__main__":
    sys.exit(main())
