"""The process around a worker's engine (vLLM or simulated): see README.md."""
