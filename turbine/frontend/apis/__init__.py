"""Fronts that reuse or skip the stages: the Responses API and its stored state, batches of completion
prompts, embeddings, and Anthropic's Messages API."""
