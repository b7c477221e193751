"""The postprocess stage: workers' outputs become `Delta`s (stage.py: detokenized, stopped, counted,
run through the output parsers in parsers/), then the chat / completions shapes (format.py)."""
