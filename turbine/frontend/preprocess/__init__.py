"""The preprocess stage: a request body becomes `Prepared` (stage.py): decoded against its schema
(schemas.py), checked, templated and tokenized (tokenizer.py), its media, prompt embeddings,
output constraints and tools resolved."""
