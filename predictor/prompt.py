"""What the length predictor reads: the user's prompt, cut as the labels cut it, followed by an
instruction asking for the length of the answer to come. The chat template is the serving
model's own, so the prediction conditions on exactly what the decoder will see, plus the question."""
from __future__ import annotations

INSTRUCTION = (
    "\n\n(Before you reply: think about how long your reply to the message above will be, "
    "counted in tokens.)"
)
MAX_PROMPT_TOKENS = 384  # the labels cut prompts to this; so does prediction


def prediction_ids(tokenizer, prompt: str, max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> list[int]:
    """Token ids of the chat-templated prompt + instruction, ending where the answer would start."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"][:max_prompt_tokens]
    text = tokenizer.decode(ids) + INSTRUCTION
    return list(tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    ))
