"""The chat benchmark's own prompts: varied requests a user types into a chat.

Each is one user turn, rendered through the target's chat template (with the
assistant's turn opened), so every method decodes the reply a chat user would get.
Kinds differ on purpose: an explanation or a letter is free text the n-gram minion
rarely predicts, code and lists are regular, and a summary or a rewrite copies from
the prompt (what prompt lookup lives on). A tokenizer without a chat template (the
stdlib test family, the tiny stand-ins) gets the same turn as plain text.
"""

from __future__ import annotations

from benchmarks.prompts import Prompt

# (kind, user message). The order is the benchmark's order: --prompts N takes the first N.
CHAT_PROMPTS: tuple[tuple[str, str], ...] = (
    ("explanation", "Explain how a refrigerator keeps food cold, in simple terms."),
    ("code", "Write a Python function that reverses a singly linked list, with a short docstring."),
    ("list", "List seven tips for getting better sleep, one line each."),
    ("letter", "Write a short, polite letter to my landlord asking to fix the kitchen faucet, "
               "which has been leaking for a week."),
    ("summary", "Summarize this paragraph in two sentences:\n\n"
                "The city council met on Tuesday to discuss the new bicycle lanes on Main Street. "
                "Supporters said the lanes made cycling safer and brought more customers to local "
                "shops. Opponents said the lanes removed too many parking spaces and slowed down "
                "delivery trucks. After three hours of debate, the council voted to keep the lanes "
                "for another six months and to study their effect on traffic and business."),
    ("how-to", "How do I make a simple tomato pasta sauce? Give the steps."),
    ("code", "Write a SQL query that returns the ten customers who spent the most money in 2023, "
             "from tables customers(id, name) and orders(id, customer_id, total, created_at)."),
    ("comparison", "What is the difference between a virus and a bacterium?"),
    ("rewrite", "Rewrite this sentence to be more formal: \"hey, can u send me the report by "
                "tomorrow? thx, we really need it for the meeting.\""),
    ("story", "Write the opening paragraph of a story about a lighthouse keeper who finds a message "
              "in a bottle."),
    ("list", "Give me a packing list for a three-day hiking trip."),
    ("explanation", "Why is the sky blue?"),
)

CALIBRATION_PROMPT = ("explanation", "Describe what a compiler does, step by step.")
"""Never measured: the warm-up and the calibration round run on it."""


def render(tokenizer, message: str) -> list[int]:
    """Token ids of one user turn with the assistant's reply opened."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return [int(i) for i in ids]
    return list(tokenizer.encode(f"User: {message}\nAssistant:", add_special_tokens=False))


def chat_prompts(tokenizer, count: int) -> list[Prompt]:
    """The first `count` prompts (at most len(CHAT_PROMPTS)), rendered for `tokenizer`."""
    if not 1 <= count <= len(CHAT_PROMPTS):
        raise ValueError(f"--prompts must be 1 to {len(CHAT_PROMPTS)} (the benchmark's own chat prompts), "
                         f"got {count}")
    return [Prompt(f"{i + 1}:{kind}", render(tokenizer, text), text)
            for i, (kind, text) in enumerate(CHAT_PROMPTS[:count])]


def calibration_prompt(tokenizer) -> Prompt:
    kind, text = CALIBRATION_PROMPT
    return Prompt(f"calibration:{kind}", render(tokenizer, text), text)
