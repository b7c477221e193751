"""Text mode: models whose workers run with --use-vllm-tokenizer (card `model_input: "text"`).
The frontend loads no tokenizer for them; a request goes out as text (GenerateRequest.text: the
chat messages with their template arguments, or the completion prompt) and comes back as text
with the stop strings already applied by the engine. The worker checks the context length
(InvalidRequest -> 400) and reports the prompt's token count.

Routing: with no token ids the KV router sees no blocks, so it routes text-mode requests by load
alone (a completion prompt given as token ids goes out as ids and is routed on them). The postprocess stage passes the text through (postprocess.TextPostprocess). Logprobs
(their tokens would need turning into text here) are refused by name."""

from __future__ import annotations

from turbine.frontend.errors import RequestError
from turbine.frontend.preprocess.schemas import ChatCompletionRequest, CompletionRequest, stop_list
from turbine.protocol.generate import TextInput



def refuse_in_text_mode(model_name: str, what: str, param: str | None = None) -> RequestError:
    """The error for a feature that needs the frontend's tokenizer (e.g. /tokenize)."""
    return RequestError(f"{what} is not available for {model_name!r}: it is served in text mode "
                        "(its worker runs with --use-vllm-tokenizer; the frontend has no tokenizer for it)",
                        param=param)


def text_input(req: ChatCompletionRequest | CompletionRequest, model_name: str,
               prompt: str | list[int] | None = None) -> tuple[TextInput, list[int]]:
    """The request's prompt for the worker: as text, or a completion prompt's token ids as they are
    (then TextInput has neither prompt nor messages; the output still comes back as text).
    RequestError for what text mode cannot do."""
    if req.logprobs is not None and req.logprobs is not False:  # completions' logprobs=0 asks for them too
        raise refuse_in_text_mode(model_name, "logprobs", param="logprobs")
    common = dict(stop=stop_list(req.stop) or None, include_stop_str_in_output=req.include_stop_str_in_output,
                  skip_special_tokens=req.skip_special_tokens)
    if isinstance(req, ChatCompletionRequest):
        if not req.messages:
            raise RequestError("a chat needs at least one message", param="messages")
        return TextInput(messages=req.messages, tools=req.tools, chat_template_kwargs=req.chat_template_kwargs,
                         add_generation_prompt=req.add_generation_prompt, **common), []
    # `prompt`: this completion prompt (one of a batch, openai_schemas.prompts_of)
    if req.echo and not isinstance(prompt, str):
        raise refuse_in_text_mode(model_name, "echo of a token-id prompt", param="echo")
    if isinstance(prompt, str):
        return TextInput(prompt=prompt, **common), []
    return TextInput(**common), prompt  # the engine checks the ids against its vocabulary
