"""The 16-chat SmolLM2 set: 14 one-question chats, one with a system prompt, one with an
earlier turn. tests/test_smollm2.py checks the float32 engine against transformers on it,
bench/bench_bf16_accuracy.py measures bfloat16 on it."""
from __future__ import annotations

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "What is 17 + 25?",
    "Name three primary colors.", "Translate 'good morning' into Spanish.", "Why is the sky blue?",
    "Give me a synonym for 'happy'.", "What does a CPU do?", "List the days of the week.",
    "Who wrote Romeo and Juliet?", "Explain photosynthesis in one sentence.", "What is the boiling point of water?",
    "Suggest a name for a pet cat.", "How many legs does a spider have?",
]
CONVERSATIONS = [[{"role": "user", "content": q}] for q in QUESTIONS] + [
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "How are you?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fun fact about octopuses."}],
]
