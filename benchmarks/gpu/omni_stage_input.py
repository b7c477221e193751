"""The text→image proof pipeline's hand-off (benchmarks/gpu/gpu_omni.py): the diffusion stage draws the LLM stage's
text, as a prompt-expansion pipeline would. vLLM-Omni's orchestrator imports it by the stage config's
`custom_process_input_func` path, so it imports nothing heavy."""

from __future__ import annotations


def llm_text_as_prompt(source_outputs, prompt=None, requires_multimodal_data=False, **_):
    """The diffusion stage's prompt: the LLM stage's finished text (the original prompt's text when it said
    nothing), with the original prompt's other fields (its `modalities`)."""
    original = prompt[0] if isinstance(prompt, list) and prompt else prompt
    fields = dict(original) if isinstance(original, dict) else {}
    text = ""
    if source_outputs:
        outputs = getattr(source_outputs[0], "outputs", None) or []
        if outputs:  # the whole text at the finish (a DELTA output's `text` is its last piece only)
            text = (getattr(outputs[0], "cumulative_text", None) or getattr(outputs[0], "text", "") or "").strip()
    fields.pop("prompt_token_ids", None)
    fields["prompt"] = text or fields.get("prompt") or (original if isinstance(original, str) else "")
    return fields
